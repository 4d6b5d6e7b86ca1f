"""CGX's ``torch_cgx`` module, installed by mpx-quantize: CGX scripts run unchanged.

Every CGX script starts with ``import torch_cgx``; with mpx-quantize installed
it imports, registers the ``"cgx"`` torch.distributed backend
(:mod:`mpx.quantize.torch_backend`: mpx's backend with the quantized
allreduce) and offers CGX's layer filtering::

    import torch.distributed as dist
    import torch_cgx

    dist.init_process_group("cgx", init_method="env://", rank=rank)
    torch_cgx.register_model([(name, p.numel()) for name, p in model.named_parameters()])
    torch_cgx.exclude_layer("bn")      # batch norm layers stay exact
    torch_cgx.exclude_layer("bias")

configured by CGX's variables (``CGX_COMPRESSION_QUANTIZATION_BITS``, default 32:
no quantization; ``CGX_COMPRESSION_BUCKET_SIZE``, ...), started by ``mpxrun -n 2 --
python train.py`` (or ``mpirun``). MPI starts only when a ``"cgx"`` group is made.
"""

from __future__ import annotations

from mpx._quantize_autoload import register as _register
from mpx.quantize.config import register_model, registry
from mpx.quantize.errors import QuantizeValueError

__all__ = ["exclude_layer", "register_model"]


def exclude_layer(part: str) -> None:
    """Keeps the registered layers whose name contains ``part`` exact (``"bn"``, ``"bias"``).

    As in CGX, after :func:`register_model`: the ``"cgx"`` group knows a DDP
    bucket's layers only by the names and sizes registered, so before that
    the exclusion would match nothing and every layer would be quantized.

    Raises:
        QuantizeValueError: no layers are registered yet (the message says
            what to call first).
    """
    if not registry.order:
        raise QuantizeValueError(
            f"torch_cgx.exclude_layer({part!r}) before torch_cgx.register_model: no layers "
            "are registered, so nothing would be excluded and every layer would be quantized; "
            "call torch_cgx.register_model([(name, p.numel()) for name, p in "
            "model.named_parameters()]) first"
        )
    registry.exclude_layer(part)


# Already done by `import torch` through the torch.backends entry point, unless
# TORCH_DEVICE_BACKEND_AUTOLOAD=0 turned that off: idempotent, starts no MPI.
_register()
