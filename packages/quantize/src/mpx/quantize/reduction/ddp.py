"""The compressed allreduce as a ``DistributedDataParallel`` communication hook.

DDP hands the hook one flat gradient bucket at a time; the hook splits it back
into parameters so that layer filtering works (1-D parameters, excluded names
and tiny tensors stay in full precision), reduces them with
:func:`allreduce_tensors` (op ``"avg"``, as DDP's own allreduce), and returns
a completed future. Communication goes through ``mpx.collectives`` over MPI,
whichever backend (``gloo`` or ``mpx``) DDP was built on.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at
# runtime (bucket: dist.GradBucket, return: Future[Tensor]).
import torch
import torch.distributed as dist

from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.reduction.compressed_allreduce import allreduce, allreduce_tensors
from mpx.quantize.reduction.config import registry
from mpx.quantize.reduction.state import QuantizeState

__all__ = ["ddp_comm_hook"]


def ddp_comm_hook(
    state: QuantizeState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # (torch's stubs lack it)
) -> torch.futures.Future[torch.Tensor]:
    """Averages a DDP gradient bucket with quantized communication.

    Example::

        state = QuantizeState(CompressionConfig(bits=4), model=model)
        ddp = DistributedDataParallel(model)
        ddp.register_comm_hook(state, ddp_comm_hook)
    """
    buffer = bucket.buffer()
    views: list[torch.Tensor] = []
    names: list[str | None] = []
    offset = 0
    for param in bucket.parameters():
        n = param.numel()
        views.append(buffer[offset : offset + n].view(param.shape))
        names.append(state.name_of(param))
        offset += n
    if any(name is None for name in names):
        names = _names_by_size(state, [v.numel() for v in views], names)
    if offset == buffer.numel():
        allreduce_tensors(views, state.comm, state.config, "avg", names=names, state=state)
    else:  # not laid out parameter by parameter: one flat tensor, judged by its size
        allreduce(
            buffer, state.comm, op="avg", config=state.config, state=state, key=bucket.index()
        )
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(buffer)
    return future


def _names_by_size(
    state: QuantizeState, numels: list[int], names: list[str | None]
) -> list[str | None]:
    """Fills unknown names from CGX-style ``register_model([(name, numel), ...])``.

    Exclusion by name cannot be skipped in silence: when the config excludes
    layers and the names stay unknown, this raises, saying what is missing.
    """
    found = registry.names_for(numels)
    if found is not None:
        return [
            known if known is not None else guess for known, guess in zip(names, found, strict=True)
        ]
    excluded = (*state.config.exclude, *registry.excluded)
    if excluded:
        raise QuantizeValueError(
            f"ddp_comm_hook: layers {list(excluded)} are to be excluded by name, but this "
            f"gradient bucket's parameters (sizes {numels}) have no names; pass the model "
            "(QuantizeState(config, model=model)) or register it "
            "(mpx.quantize.register_model(model)) before training"
        )
    return names
