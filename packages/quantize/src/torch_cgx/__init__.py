"""CGX's ``torch_cgx`` module, installed by mpx-quantize: CGX scripts run unchanged.

A CGX compatibility shim over mpx.quantize: the import name is CGX's (hence a
top-level package beside ``mpx``), the work is mpx.quantize's
(:mod:`mpx.quantize.cgx`: the ``"cgx"`` backend and CGX's per-layer table;
:mod:`mpx.quantize.reduction`: the layer registry). Nothing in mpx imports it.

Every CGX script starts with ``import torch_cgx``; with mpx-quantize installed
it imports, registers the ``"cgx"`` torch.distributed backend
(:mod:`mpx.quantize.cgx.torch_backend`: mpx's backend with the quantized
allreduce) and offers CGX's layer filtering::

    import torch.distributed as dist
    import torch_cgx

    dist.init_process_group("cgx", init_method="env://", rank=rank)
    torch_cgx.register_model([(name, p.numel()) for name, p in model.named_parameters()])
    torch_cgx.exclude_layer("bn")      # batch norm layers stay exact
    torch_cgx.exclude_layer("bias")

configured by CGX's variables (``CGX_COMPRESSION_QUANTIZATION_BITS``, default 32:
no quantization; ``CGX_COMPRESSION_BUCKET_SIZE``, ...; read again at every
all_reduce, as CGX), started by ``mpxrun -n 2 -- python train.py``, ``mpirun``,
MPICH's ``mpiexec`` or ``srun``: CGX's scripts read Open MPI's
``OMPI_COMM_WORLD_RANK``/``_SIZE`` (and ``_LOCAL_*``) and stop with "Launch with
mpirun" without them, so ``import torch_cgx`` sets them from whichever
launcher started the process where Open MPI did not (nothing is overwritten).
MPI starts only when a ``"cgx"`` group is made.

CGX's own functions, with CGX's semantics (written from its documentation;
``cgx_utils.cgx_hook`` calls them)::

    torch_cgx.register_layer(bucket_idx, layer_idx, numel, bits, bucket_size)
    torch_cgx.set_quantization_bits(bucket_idx, layer_idx, bits)
    torch_cgx.set_quantization_bucket_size(bucket_idx, layer_idx, bucket_size)
    dist.Backend.register_backend("cgx", torch_cgx.createProcessGroupCGX)  # done already
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

from mpx._quantize_autoload import register as _register
from mpx.launch import LaunchEnvironmentError, environment, open_mpi_variables
from mpx.quantize.cgx import layer_table
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.reduction import register_model, registry

__all__ = [
    "clear_layers",
    "createProcessGroupCGX",
    "exclude_layer",
    "register_layer",
    "register_model",
    "set_quantization_bits",
    "set_quantization_bucket_size",
]


def register_layer(
    bucket_idx: int, layer_idx: int, numel: int, bits: int, bucket_size: int
) -> None:
    """Says that DDP bucket ``bucket_idx`` holds layer ``layer_idx`` of ``numel`` elements.

    The layer is then all-reduced at ``bits`` (1-8; 32: exact; 0: the
    ``CGX_COMPRESSION_QUANTIZATION_BITS`` of the moment) with ``bucket_size``
    values per quantization bucket (0: ``CGX_COMPRESSION_BUCKET_SIZE``). As in
    CGX, once a layer is registered each all_reduce of 16 elements or more on
    the ``"cgx"`` group is the next registered bucket, in index order, and
    must have its layers' total size.

    Raises:
        QuantizeValueError: an index is negative, ``numel`` is not positive,
            ``bits`` or ``bucket_size`` is out of range.
    """
    layer_table.register_layer(bucket_idx, layer_idx, numel, bits, bucket_size)


def set_quantization_bits(bucket_idx: int, layer_idx: int, bits: int) -> None:
    """Changes a registered layer's bits (1-8; 32: exact; 0: the environment's)."""
    layer_table.set_bits(bucket_idx, layer_idx, bits)


def set_quantization_bucket_size(bucket_idx: int, layer_idx: int, bucket_size: int) -> None:
    """Changes a registered layer's bucket size (0: ``CGX_COMPRESSION_BUCKET_SIZE``).

    CGX's own binding of this name sets the layer's bits instead (a slip in
    its C++); this does what the name says.
    """
    layer_table.set_bucket_size(bucket_idx, layer_idx, bucket_size)


def clear_layers() -> None:
    """Forgets every ``register_layer`` (not in CGX): tensors are then taken whole again."""
    layer_table.clear()


def createProcessGroupCGX(*args: Any) -> Any:  # CGX's name
    """The ``"cgx"`` backend's creator, as CGX's module exports it.

    Takes torch's two forms: ``(options, backend_options)`` (``extended_api=True``,
    how ``"cgx"`` is registered) and ``(store, rank, size, timeout)`` (a plain
    ``register_backend("cgx", torch_cgx.createProcessGroupCGX)``, as CGX's
    ``__init__`` does), the latter for the whole world only: it does not say
    which ranks a smaller group has.

    Raises:
        QuantizeValueError: another number of arguments, or the plain form for
            a group smaller than the world.
    """
    from mpx.quantize.cgx.torch_backend import CGXProcessGroup  # here: starts MPI

    if len(args) in (1, 2):
        return CGXProcessGroup.create(*args)
    if len(args) == 4:
        _store, rank, size, timeout = args
        from mpx.collectives import world

        if size != world().size:
            raise QuantizeValueError(
                f"torch_cgx.createProcessGroupCGX(store, rank={rank}, size={size}, timeout): "
                f"the plain creator makes the whole world's group ({world().size} ranks) only; "
                "register 'cgx' with extended_api=True (import torch_cgx does) for a subgroup"
            )
        options = SimpleNamespace(
            group_rank=rank,
            group_size=size,
            global_ranks_in_group=list(range(size)),
            timeout=timeout if isinstance(timeout, timedelta) else None,
        )
        return CGXProcessGroup.create(options)
    raise QuantizeValueError(
        f"torch_cgx.createProcessGroupCGX takes (options, backend_options) or (store, rank, "
        f"size, timeout), got {len(args)} arguments"
    )


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


def _open_mpi_names() -> None:
    """Open MPI's ``OMPI_COMM_WORLD_*`` from the launcher's own variables, where none is
    set: CGX's scripts find their rank there (see the module docstring). No MPI starts."""
    here = os.environ  # noqa: TID251 (the process's own environment is what is written)
    if any(name.startswith("OMPI_COMM_WORLD_") for name in here):
        return  # Open MPI's launcher, or the user: theirs stand
    with contextlib.suppress(LaunchEnvironmentError):  # then the script says what is missing
        here.update(open_mpi_variables(environment(), here))


_open_mpi_names()
