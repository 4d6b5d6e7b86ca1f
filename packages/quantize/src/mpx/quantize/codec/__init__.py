"""The quantizer: values in buckets, each a ``min``, a ``unit`` and 1-8 bit codes.

What lives here: ``format`` (:class:`QuantizedTensor`, the one uint8 buffer
``[mins | units | raw tail | packed codes]`` and its layout), ``reference``
(the pure-torch quantizer: the specification, every formula in its order),
``backends`` (loading the compiled kernels, ``mpx.quantize._cpu`` and
``mpx.quantize._cuda``, which CMake installs beside the package's
``__init__``, not here) and ``kernels`` (:func:`quantize`,
:func:`dequantize`, :func:`dequantize_add`: the compiled kernels, or the
reference, all bit-identical). Nothing here communicates.

What it may import: ``mpx.quantize.errors`` and torch. Not the compressed
allreduce (``reduction``) or the CGX compatibility (``cgx``): both build on
this one, through this ``__init__``.
"""

from mpx.quantize.codec import reference
from mpx.quantize.codec.backends import available_backends, build_info
from mpx.quantize.codec.format import FLOAT_DTYPES, QuantizedTensor, check_bucket_size, layout
from mpx.quantize.codec.kernels import dequantize, dequantize_add, quantize

__all__ = [
    "FLOAT_DTYPES",
    "QuantizedTensor",
    "available_backends",
    "build_info",
    "check_bucket_size",
    "dequantize",
    "dequantize_add",
    "layout",
    "quantize",
    "reference",
]
