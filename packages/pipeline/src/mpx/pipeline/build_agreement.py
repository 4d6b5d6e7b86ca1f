"""Every rank builds the same pipeline: the arguments that must agree, compared once.

A :class:`~mpx.pipeline.Pipeline` is built on every rank from the same call.
When the ranks pass different arguments, nothing in the messages says so: with
``balance=[3, 3]`` on rank 0 and ``[2, 4]`` on rank 1 layer 2 runs on both
ranks and training goes on with a wrong loss; different schedules or chunk
counts post receives that never match and the first step hangs until the
timeout. So before anything else moves, the ranks compare what they were
given::

    rank 0: Pipeline(..., balance=[3, 3], schedule="1f1b", chunks=4)  --+
                                                                         +-- check_same: one small
    rank 1: Pipeline(..., balance=[2, 4], schedule="1f1b", chunks=4)  --+   collective (a hash)
        -> every rank: PipelineMismatchError("Pipeline: ranks disagree on balance:
                       rank 0 passed [3, 3], rank 1 [2, 4]; ...")

The comparison is :meth:`mpx.collectives.Communicator.check_same`: one hash
per rank compared like a collective call (the values travel only after a
mismatch), so its cost is one small collective per ``Pipeline(...)``, and like
every such check it is off under ``MPX_CHECK=0``. It runs before the
arguments are validated, so a bad value passed on one rank only is this
mismatch on every rank rather than an error on that rank and a hang on the
others.

What is compared is what decides which messages move and which layers run
where; what stays a rank's own business (``checkpoint``: recomputing inside a
stage; ``seed``; ``sample``, read on the first stage only) is not.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Mapping
from typing import Any

from torch import nn

from mpx.collectives import Communicator, MismatchError
from mpx.pipeline.errors import PipelineMismatchError, PipelineValueError
from mpx.pipeline.schedule import canonical, stages_per_rank

__all__ = ["agree_on_build", "build_fields"]


class _Listed(tuple[Hashable, ...]):
    """A list or tuple as compared: hashable, and shown as the list the user passed."""

    def __repr__(self) -> str:
        return repr(list(self))


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable whose repr is the same on every rank (lists as tuples,
    mappings as sorted pairs), for comparison and for the error's message."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _frozen(v)) for k, v in value.items()))
    if isinstance(value, list | tuple):
        return _Listed(_frozen(v) for v in value)
    if isinstance(value, int | float | str | bool | None):
        return value
    return repr(value)


def build_fields(
    module: nn.Module,
    balance: Any,
    chunks: Any,
    schedule: Any,
    stages: Any,
    pass_costs: Any,
    data_parallel_size: int,
    async_options: Mapping[str, Any],
) -> dict[str, Hashable]:
    """What every rank must pass alike, as compared (and shown in the error).

    A schedule's other spelling (torch's ``"Interleaved1F1B"``) and a default
    ``stages_per_rank`` compare as what they mean; a value that is not valid
    compares as given (the validation after the comparison names it).
    """
    with contextlib.suppress(PipelineValueError):
        schedule = canonical(schedule)
    with contextlib.suppress(PipelineValueError):
        stages = stages_per_rank(schedule, stages)
    layers = list(module) if isinstance(module, nn.Sequential) else [module]
    return {
        "schedule": _frozen(schedule),
        "chunks": _frozen(chunks),
        "stages_per_rank": _frozen(stages),
        "balance": "measured (balance=None)" if balance is None else _frozen(balance),
        "pass_costs": _frozen(pass_costs),
        # The layer count decides how a balance splits; the types catch a model
        # built differently (another depth of blocks, a layer left out).
        "layers": len(layers),
        "layer types": tuple(type(layer).__name__ for layer in layers),
        "data_parallel_comm size": data_parallel_size,
        **{name: _frozen(value) for name, value in async_options.items()},
    }


def agree_on_build(comm: Communicator, fields: Mapping[str, Hashable]) -> None:
    """Raises :class:`PipelineMismatchError` on every rank if the ranks' ``fields`` differ.

    Collective over the pipeline's ranks (one small collective; nothing under
    ``MPX_CHECK=0``).
    """
    try:
        comm.check_same("Pipeline", fields)
    except MismatchError as error:
        raise PipelineMismatchError(
            f"{error} (and the arguments of Pipeline(...) that decide which messages "
            "move and where each layer runs: build the pipeline alike on every rank)"
        ) from None
