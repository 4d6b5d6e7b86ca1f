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

With ``data_parallel_comm`` (2-D) the replicas of a stage must agree too: on
``compression`` (a replica quantizing while another does not would exchange
buffers of different layouts) and on which stage they hold. The pipelines are
the rows of a grid, the replicas its columns; each check raises on its own
row or column only, so two more small collectives tell every rank::

    row check  ->  column check  ->  row: any failure?  ->  column: any failure?

after which every rank of the grid raises the same PipelineMismatchError
(every column crosses every row).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from torch import nn

from mpx.collectives import Communicator, MismatchError
from mpx.collectives.building_blocks import checks_enabled
from mpx.pipeline.errors import PipelineMismatchError, PipelineValueError
from mpx.pipeline.schedules import canonical, stages_per_rank

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
    compression: Any = None,
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
        "compression": _compression(compression),
    }


def _compression(value: Any) -> Hashable:
    """``compression=`` as compared: an ``mpx.quantize.CompressionConfig`` by its fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _frozen({"type": type(value).__name__, **dataclasses.asdict(value)})
    return _frozen(value)


def agree_on_build(
    comm: Communicator,
    fields: Mapping[str, Hashable],
    replicas: Communicator | None = None,
) -> None:
    """Raises :class:`PipelineMismatchError` on every rank if the ranks' ``fields`` differ.

    Collective over the pipeline's ranks (one small collective; nothing under
    ``MPX_CHECK=0``) and, with ``replicas`` of more than one rank, over the
    replicas too (three more; see the module's doc): the replicas compare
    ``compression`` and the stage they hold.
    """
    if replicas is None or replicas.size == 1:
        try:
            comm.check_same("Pipeline", fields)
        except MismatchError as error:
            raise _mismatch(error) from None
        return
    if not checks_enabled():
        return
    found: str | None = None
    try:
        comm.check_same("Pipeline", fields)
    except MismatchError as error:
        found = str(_mismatch(error))
    mine = {"stage": comm.rank, "stages": comm.size, "compression": fields.get("compression")}
    try:
        replicas.check_same("Pipeline replicas (data_parallel_comm)", mine)
    except MismatchError as error:
        found = found or str(_mismatch(error))
    # A row or a column that failed tells its row, then every column (each crosses it).
    for group in (comm, replicas):
        found = next((m for m in group.allgather_object(found) if m is not None), None)
    if found is not None:
        raise PipelineMismatchError(found)


def _mismatch(error: MismatchError) -> PipelineMismatchError:
    return PipelineMismatchError(
        f"{error} (and the arguments of Pipeline(...) that decide which messages "
        "move and where each layer runs: build the pipeline alike on every rank)"
    )
