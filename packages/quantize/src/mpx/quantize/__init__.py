"""mpx-quantize: bucket quantization kernels (C++ and CUDA) and the compressed allreduce.

Values are cut into buckets; each bucket keeps its ``min`` and ``unit`` and
every value a 1-8 bit code (CGX's max-min quantization, reimplemented). The
kernels need only torch; the compressed allreduce runs on mpx-collectives.

Example::

    import mpx.quantize as mq
    q = mq.quantize(grad, bits=4, bucket_size=512)     # QuantizedTensor, ~1/7 of fp32
    grad_hat = mq.dequantize(q)
    mq.allreduce(flat_grads, bits=4, op="avg")          # compressed, over mpx.collectives
"""

from importlib import metadata as _metadata

from mpx.quantize.allreduce import allreduce, allreduce_tensors
from mpx.quantize.backends import available_backends, build_info
from mpx.quantize.config import CompressionConfig, exclude_layer, register_model
from mpx.quantize.ddp import ddp_comm_hook
from mpx.quantize.errors import QuantizeError, QuantizeTypeError, QuantizeValueError
from mpx.quantize.format import QuantizedTensor
from mpx.quantize.kernels import dequantize, dequantize_add, quantize
from mpx.quantize.state import QuantizeState

__all__ = [
    "CompressionConfig",
    "QuantizeError",
    "QuantizeState",
    "QuantizeTypeError",
    "QuantizeValueError",
    "QuantizedTensor",
    "__version__",
    "allreduce",
    "allreduce_tensors",
    "available_backends",
    "build_info",
    "ddp_comm_hook",
    "dequantize",
    "dequantize_add",
    "exclude_layer",
    "quantize",
    "register_model",
]

# pyproject.toml's version, as installed: the one place it is written.
__version__ = _metadata.version("mpx-quantize")
