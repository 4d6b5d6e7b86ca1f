"""mpx-quantize: bucket quantization kernels (C++ and CUDA) and the compressed allreduce.

Values are cut into buckets; each bucket keeps its ``min`` and ``unit`` and
every value a 1-8 bit code (CGX's max-min quantization, reimplemented). The
kernels need only torch; the compressed allreduce runs on mpx-collectives.

Example::

    import mpx.quantize as mq
    q = mq.quantize(grad, bits=4, bucket_size=512)     # QuantizedTensor, ~1/7 of fp32
    grad_hat = mq.dequantize(q)
    mq.allreduce(flat_grads, bits=4, op="avg")          # compressed, over mpx.collectives

Every public name is here; the subpackages hold the roles (see the README's
Layout): ``codec`` (the quantizer: format, the pure-torch reference, the
compiled kernels), ``reduction`` (the compressed allreduce, its config and
state, the ``when="auto"`` choice, the DDP hook) on it, and ``cgx`` (CGX
compatibility: the ``"cgx"`` torch.distributed backend, CGX's per-layer table)
on top, over ``errors`` and ``settings``. ``implementation`` is the
``impl="cgx"`` of mpx-collectives (an entry point names it). The modules
``reference``, ``compression_choice``, ``buckets`` and ``torch_backend`` here
are the documented public paths of modules that live in a subpackage.
"""

from importlib import metadata as _metadata

from mpx.quantize.codec import (
    QuantizedTensor,
    available_backends,
    build_info,
    dequantize,
    dequantize_add,
    quantize,
)
from mpx.quantize.errors import QuantizeError, QuantizeTypeError, QuantizeValueError
from mpx.quantize.reduction import (
    CompressionConfig,
    QuantizeState,
    allreduce,
    allreduce_tensors,
    ddp_comm_hook,
    exclude_layer,
    register_model,
)

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
