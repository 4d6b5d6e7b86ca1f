"""mpx-quantize: bucket quantization kernels (C++ and CUDA) and the compressed allreduce.

Values are cut into buckets; each bucket keeps its ``min`` and ``unit`` and
every value a 1-8 bit code (CGX's max-min quantization, reimplemented). The
kernels need only torch; the compressed allreduce runs on mpx-collectives.

Example::

    import mpx.quantize as mq
    q = mq.quantize(grad, bits=4, bucket_size=512)     # QuantizedTensor, ~1/7 of fp32
    grad_hat = mq.dequantize(q)
"""

from mpx.quantize.backends import available_backends, build_info
from mpx.quantize.errors import QuantizeError, QuantizeTypeError, QuantizeValueError
from mpx.quantize.format import QuantizedTensor
from mpx.quantize.kernels import dequantize, dequantize_add, quantize

__all__ = [
    "QuantizeError",
    "QuantizeTypeError",
    "QuantizeValueError",
    "QuantizedTensor",
    "__version__",
    "available_backends",
    "build_info",
    "dequantize",
    "dequantize_add",
    "quantize",
]

__version__ = "0.1.0"
