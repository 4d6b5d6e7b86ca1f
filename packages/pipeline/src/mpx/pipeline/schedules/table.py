"""Schedules as data: one table, and per rank the list of actions one executor runs.

Each schedule is declared once, in :data:`TABLE`: its name, torch's name,
where its chunks sit (a loop or a V), how many chunks per rank it runs,
whether it splits the backward, whether a list scheduler lays it out by the
passes' times, whether it is the asynchronous stream, and its generator.
Everything else asks the table (:func:`spec`). The parts, one job each:
:mod:`~mpx.pipeline.schedules.actions` (actions that print and parse back, ``2F0``),
:mod:`~mpx.pipeline.schedules.orders` (the generators),
:mod:`~mpx.pipeline.schedules.zero_bubble` (the zero-bubble list scheduler),
:mod:`~mpx.pipeline.schedules.async_layout` (the asynchronous stream) and
:mod:`~mpx.pipeline.schedules.timing` (timing the lists, drawing grids).

An :class:`Action` names a pass, its micro-batch and its (virtual) stage:
``F`` forward, ``B`` full backward, ``I`` input gradient and ``W`` weight
gradient (the Zero Bubble paper's B and W; torch.distributed.pipelining's
names, which keep ``B`` for the full backward), ``SEND_F``/``RECV_F`` and
``SEND_B``/``RECV_B`` for activations and gradients crossing to another rank,
and ``STEP`` (an optimizer step, in the asynchronous stream). Each schedule
emits the compute actions of a rank (:func:`compute_actions`);
:func:`rank_actions` adds the sends and receives; :mod:`mpx.pipeline.runtime.executor`
runs any such list. With ``stages_per_rank = v`` the model is cut into
``p·v`` virtual stages, placed in a loop (stage ``s`` on rank ``s mod p``) or,
for ``zbv`` and ``dualpipev``, in a V (rank ``r`` holds stages ``r`` and
``2p−1−r``: the first and last stage are both on rank 0).

:func:`grid` runs the lists against the data dependencies (``F(s, j)`` needs
``F(s−1, j)``, a backward of ``(s, j)`` needs one of ``(s+1, j)``, ``W`` its
``I``), one time unit per action, and prints a rank × time grid; with two
chunks per rank the second chunk's actions are in lower case (``F0``:
micro-batch 0 on the rank's first chunk, ``f0`` on its second). The grids
below are the output of ``grid(name, 3, 4)`` (three ranks, four micro-batches), and of
``grid(name, 2, 4)`` for the schedules with two chunks per rank
(``tests/test_schedule.py`` checks that they stay true). :func:`bubble_fraction`
times the same lists with ``F = I = W = 1`` and ``B = 2`` (the paper's model).

``sequential`` — naive model parallelism: one micro-batch at a time, no overlap::

    stage 0 | F0 .  .  .  .  B0 F1 .  .  .  .  B1 F2 .  .  .  .  B2 F3 .  .  .  .  B3
    stage 1 | .  F0 .  .  B0 .  .  F1 .  .  B1 .  .  F2 .  .  B2 .  .  F3 .  .  B3 .
    stage 2 | .  .  F0 B0 .  .  .  .  F1 B1 .  .  .  .  F2 B2 .  .  .  .  F3 B3 .  .

``gpipe`` — all forwards, then all backwards (last micro-batch first); bubble
``(p-1)/(m+p-1)``; every micro-batch's activations are alive at the turn::

    stage 0 | F0 F1 F2 F3 .  .  .  .  B3 B2 B1 B0
    stage 1 | .  F0 F1 F2 F3 .  .  B3 B2 B1 B0 .
    stage 2 | .  .  F0 F1 F2 F3 B3 B2 B1 B0 .  .

``1f1b`` — PipeDream-flush: ``p - s - 1`` warm-up forwards, then one forward
and one backward in turn, then the remaining backwards. The same bubble as
gpipe, but at most ``p - s`` micro-batches alive on stage ``s``::

    stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .

``async`` — 1F1B without a flush: a stage runs a forward iff
``done_fwds - done_bwds <= depth`` (``depth`` = stages after it), so the
weights a backward meets are ``depth`` updates newer than its forward's. A
call ends right after the backward that follows its last forward; the
backwards still owed run in the next call (or in ``flush``). First call::

    stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  .
    stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3

In steady state every stage alternates F and B with no bubble.

``async`` with ``split_backward`` — and ``stages_per_rank = v``: every chunk
is an asynchronous stage of its own (its depth is the virtual stages after
it; it steps its own parameters), each backward is ``I`` (sent upstream at
once) then ``W``, and :class:`AsyncLayout` lays the stream out call after
call: ``I`` first, then forwards, ``W`` deferred into what would be idle
time (a ``W`` that completes an optimizer step still goes before its chunk's
next forward, so deferring never makes a forward staler). First call, two
chunks per rank::

    rank 0 | F0 F1 f0 f1 F2 i0 F3 w0 i1 I0 w1 W0 f2 f3 .  .  i2 w2 .  .  .
    rank 1 | .  F0 F1 f0 i0 f1 w0 i1 I0 W0 I1 F2 F3 f2 w1 i2 f3 w2 i3 W1 w3

``interleaved_1f1b`` — Megatron's interleaved 1F1B (torch's
``ScheduleInterleaved1F1B``): ``v`` chunks per rank in a loop, forwards in
rounds of ``p`` micro-batches per chunk, ``2(p−r−1) + (v−1)p`` warm-up
forwards, then one forward and one backward in turn; ``m`` must be a multiple
of ``p``. The bubble shrinks about ``v`` times::

    rank 0 | F0 F1 f0 f1 F2 b0 F3 b1 f2 B0 f3 B1 .  b2 .  b3 B2 B3
    rank 1 | .  F0 F1 f0 b0 f1 b1 F2 B0 F3 B1 f2 b2 f3 b3 B2 B3 .

``looped_bfs`` — torch's ``ScheduleLoopedBFS``: each chunk runs all its
forwards before the next chunk; backwards chunk by chunk in reverse::

    rank 0 | F0 F1 F2 F3 f0 f1 f2 f3 .  .  b3 b2 b1 b0 B3 B2 B1 B0
    rank 1 | .  F0 F1 F2 F3 f0 f1 f2 f3 b3 b2 b1 b0 B3 B2 B1 B0 .

``interleaved_zb`` — zero bubble on interleaved chunks (torch's
``ScheduleInterleavedZeroBubble``): the backward split into ``I`` (on the
critical path, first whenever ready) and ``W`` (deferred into what would be
idle time); forwards wait while a rank holds as many micro-batch chunks as
interleaved 1F1B's warm-up (its memory). Laid out by a list scheduler over
the passes' times (``costs``; the grid is the unit-cost layout)::

    rank 0 | F0 F1 f0 f1 F2 i0 w0 I0 F3 i1 W0 I1 f2 w1 W1 i2 w2 I2 f3 W2 .  i3 w3 I3 W3
    rank 1 | .  F0 F1 f0 i0 w0 I0 f1 i1 W0 I1 F2 w1 f2 i2 W1 I2 F3 w2 f3 i3 W2 I3 w3 W3

``zbv`` — ZB-V (torch's ``ScheduleZBVZeroBubble``): two chunks per rank in a
V, ``I`` first, ``W`` into the gaps, at most ``2p`` chunks alive per rank::

    rank 0 | F0 F1 F2 f0 i0 w0 f1 i1 I0 w1 I1 F3 W0 f2 i2 W1 w2 I2 W2 f3 i3 w3 .  I3 W3
    rank 1 | .  F0 f0 F1 f1 i0 I0 w0 i1 I1 F2 W0 f2 w1 F3 i2 I2 W1 f3 w2 W2 i3 I3 w3 W3

``dualpipev`` — DeepSeek's DualPipeV (torch's ``ScheduleDualPipeV``): two
chunks in a V, eight phases per rank; in its main phase a forward of one
chunk and a full backward of the other go in pairs (DualPipe overlaps them
with expert-parallel communication; here they run one after the other)::

    rank 0 | F0 F1 F2 f0 i0 w0 f1 F3 b1 f2 B0 b2 f3 B1 b3 I2 W2 I3 W3
    rank 1 | .  F0 f0 F1 f1 F2 b0 f2 B0 F3 b1 f3 B1 b2 B2 i3 I3 w3 W3
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpx.pipeline.errors import PipelineValueError
from mpx.pipeline.schedules import orders
from mpx.pipeline.schedules.actions import (
    COMPUTE,
    Action,
    Op,
    PassCosts,
    format_actions,
    local_stages,
    parse_actions,
    rank_of,
)
from mpx.pipeline.schedules.async_layout import (
    AsyncLayout,
    async_actions,
    async_flush_actions,
    async_ops,
    flush_ops,
)
from mpx.pipeline.schedules.orders import Shape
from mpx.pipeline.schedules.timing import draw, max_alive, simulate, timeline

__all__ = [
    "ALIASES",
    "COMPUTE",
    "SCHEDULES",
    "SPLIT",
    "TABLE",
    "TIMED",
    "Action",
    "AsyncLayout",
    "Chunks",
    "Op",
    "PassCosts",
    "Schedule",
    "async_actions",
    "async_flush_actions",
    "async_ops",
    "bubble_fraction",
    "canonical",
    "compute_actions",
    "flush_ops",
    "format_actions",
    "grid",
    "local_stages",
    "max_alive",
    "parse_actions",
    "placement",
    "rank_actions",
    "rank_of",
    "simulate",
    "spec",
    "stage_ops",
    "stages_per_rank",
    "timeline",
]


@dataclass(frozen=True)
class Chunks:
    """How many chunks (virtual stages) per rank a schedule runs: ``default`` when
    ``stages_per_rank`` is left out, at least ``least``, at most ``most`` (None: no bound)."""

    default: int
    least: int
    most: int | None


ONE = Chunks(1, 1, 1)
"""One stage per rank."""


@dataclass(frozen=True)
class Schedule:
    """One schedule, declared once.

    Attributes:
        name: mpx's name, the value of ``Pipeline(schedule=...)``.
        torch_name: torch.distributed.pipelining's (without ``Schedule``), or None.
        placement: ``"loop"`` (virtual stage ``s`` on rank ``s mod p``) or ``"v"``.
        chunks: the chunks per rank it runs.
        split: it splits every backward into ``I`` and ``W``.
        timed: a list scheduler lays its ``W`` out by the passes' times (``pass_costs``).
        stream: the asynchronous stream (no flush; its options are ``Pipeline``'s
            async-only ones).
        generate: a rank's compute actions for one call (:mod:`mpx.pipeline.schedules.orders`).
    """

    name: str
    torch_name: str | None
    placement: str
    chunks: Chunks
    split: bool
    timed: bool
    stream: bool
    generate: Callable[[Shape], list[Action]]


TABLE = (
    Schedule("sequential", None, "loop", ONE, False, False, False, orders.sequential),
    Schedule("gpipe", "GPipe", "loop", ONE, False, False, False, orders.gpipe),
    Schedule("1f1b", "1F1B", "loop", ONE, False, False, False, orders.one_f_one_b),
    # Any chunks per rank: with two or more, each chunk is a stage of the stream.
    Schedule("async", None, "loop", Chunks(1, 1, None), False, False, True, orders.async_stream),
    Schedule(
        "interleaved_1f1b",
        "Interleaved1F1B",
        "loop",
        Chunks(2, 2, None),
        False,
        False,
        False,
        orders.interleaved_1f1b,
    ),
    Schedule(
        "looped_bfs",
        "LoopedBFS",
        "loop",
        Chunks(2, 2, None),
        False,
        False,
        False,
        orders.looped_bfs,
    ),
    Schedule(
        "interleaved_zb",
        "InterleavedZeroBubble",
        "loop",
        Chunks(2, 2, None),
        True,
        True,
        False,
        orders.interleaved_zb,
    ),
    Schedule("zbv", "ZBVZeroBubble", "v", Chunks(2, 2, 2), True, True, False, orders.zbv),
    Schedule("dualpipev", "DualPipeV", "v", Chunks(2, 2, 2), True, False, False, orders.dualpipev),
)
"""Every schedule, in the order of :data:`SCHEDULES`."""

_BY_NAME = {s.name: s for s in TABLE}

SCHEDULES = tuple(s.name for s in TABLE)
"""The values of ``Pipeline(schedule=...)``."""

ALIASES = {s.torch_name: s.name for s in TABLE if s.torch_name is not None}
"""torch.distributed.pipelining's schedule names (without ``Schedule``), accepted too."""

SPLIT = tuple(s.name for s in TABLE if s.split)
"""Schedules that split backwards into ``I`` and ``W``."""

TIMED = tuple(s.name for s in TABLE if s.timed)
"""Schedules whose lists a list scheduler lays out by the passes' times (``costs``)."""

_COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}


def spec(schedule: str) -> Schedule:
    """The table's entry for ``schedule`` (torch's names accepted).

    Raises:
        PipelineValueError: an unknown name.
    """
    found = _BY_NAME.get(ALIASES.get(schedule, schedule))
    if found is None:
        raise PipelineValueError(
            f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)} "
            f"(or torch's {', '.join(ALIASES)})"
        )
    return found


def canonical(schedule: str) -> str:
    """The mpx name of ``schedule`` (torch's names accepted).

    Raises:
        PipelineValueError: an unknown name.
    """
    return spec(schedule).name


def placement(schedule: str) -> str:
    """``"v"`` for the V-shaped schedules, else ``"loop"``."""
    return spec(schedule).placement


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Chunks per rank for ``schedule``: ``requested``, or its default (2 where it needs >= 2).

    Raises:
        PipelineValueError: a count the schedule cannot run.
    """
    entry = spec(schedule)
    name, rule = entry.name, entry.chunks
    if requested is not None and (not isinstance(requested, int) or requested < 1):
        raise PipelineValueError(f"stages_per_rank={requested!r} must be a positive int")
    if rule.most == 1 and requested not in (None, 1):
        several = ", ".join(s.name for s in TABLE if s.chunks.least > 1)
        raise PipelineValueError(
            f"schedule={name!r} runs one stage per rank; stages_per_rank={requested} needs "
            f"one of {several}"
        )
    if rule.most == rule.least and requested not in (None, rule.least):
        raise PipelineValueError(
            f"schedule={name!r} places exactly {rule.least} chunks per rank in a V; "
            f"stages_per_rank={requested} cannot run: pass {rule.least} (or leave it out)"
        )
    if rule.most == rule.least:
        return rule.least
    v = rule.default if requested is None else requested
    if v < rule.least:
        raise PipelineValueError(
            f"schedule={name!r} interleaves chunks: stages_per_rank={v} must be >= "
            f"{rule.least} (stages_per_rank=1 is schedule='1f1b' or 'gpipe')"
        )
    return v


def _check(schedule: str, stage: int, num_stages: int, chunks: int) -> Schedule:
    entry = spec(schedule)
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise PipelineValueError(f"stage={stage} is not in [0, {num_stages}) stages")
    if chunks < 1:
        raise PipelineValueError(f"chunks={chunks} must be >= 1")
    return entry


def compute_actions(
    schedule: str,
    rank: int,
    ranks: int,
    chunks: int,
    v: int = 1,
    split: bool = False,
    costs: PassCosts | None = None,
) -> list[Action]:
    """The compute actions of ``rank`` for one mini-batch of ``chunks`` micro-batches.

    Args:
        v: chunks per rank (see :func:`stages_per_rank`).
        split: ``async`` only: each backward as ``I`` then ``W``.
        costs: ``interleaved_zb`` and ``zbv``: the passes' times, which their
            list scheduler lays the ``W`` out by; None: the paper's unit
            costs. The other schedules' lists do not depend on times.

    For ``async`` this is the first call of a fresh pipeline (see
    :func:`async_actions`, and :class:`AsyncLayout` for ``v >= 2``).

    Raises:
        PipelineValueError: a schedule that cannot run these sizes (named with the fix).
    """
    entry = _check(schedule, rank, ranks, chunks)
    v = stages_per_rank(entry.name, None if v == 1 else v)
    return entry.generate(Shape(rank, ranks, chunks, v, split, costs))


def stage_ops(schedule: str, stage: int, num_stages: int, chunks: int) -> list[Op]:
    """The ``(kind, micro-batch)`` ops of ``stage`` (one stage per rank) for one mini-batch."""
    return [(a.kind, a.mb) for a in compute_actions(schedule, stage, num_stages, chunks)]


def rank_actions(
    schedule: str,
    rank: int,
    ranks: int,
    chunks: int,
    v: int = 1,
    actions: list[Action] | None = None,
    costs: PassCosts | None = None,
) -> list[Action]:
    """``rank``'s compute actions with the sends and receives of what crosses ranks.

    ``RECV_F`` goes right before the forward that needs a remote activation,
    ``SEND_F`` right after the forward that makes one; ``RECV_B``/``SEND_B`` the
    same for the gradients, around ``B`` or ``I`` (``W`` sends nothing).
    A chunk handing to the next chunk on the same rank (the V's turn) sends nothing.
    """
    style = placement(schedule)
    v = stages_per_rank(schedule, None if v == 1 else v)
    n = ranks * v
    out: list[Action] = []
    if actions is None:
        actions = compute_actions(schedule, rank, ranks, chunks, v, costs=costs)
    for a in actions:
        s = a.stage
        if a.kind == "F":
            remote_in = s > 0 and rank_of(s - 1, ranks, style) != rank
            remote_out = s < n - 1 and rank_of(s + 1, ranks, style) != rank
            out += [Action("RECV_F", a.mb, s)] if remote_in else []
            out.append(a)
            out += [Action("SEND_F", a.mb, s)] if remote_out else []
        elif a.kind in ("B", "I"):
            remote_in = s < n - 1 and rank_of(s + 1, ranks, style) != rank
            remote_out = s > 0 and rank_of(s - 1, ranks, style) != rank
            out += [Action("RECV_B", a.mb, s)] if remote_in else []
            out.append(a)
            out += [Action("SEND_B", a.mb, s)] if remote_out else []
        else:
            out.append(a)
    return out


def _lists(
    schedule: str, ranks: int, chunks: int, v: int | None, split: bool = False
) -> tuple[list[list[Action]], int]:
    name = canonical(schedule)
    k = stages_per_rank(name, v)
    return [compute_actions(name, r, ranks, chunks, k, split) for r in range(ranks)], k


def grid(
    schedule: str,
    num_stages: int,
    chunks: int,
    stages_per_rank: int | None = None,
    split: bool = False,
) -> str:
    """The rank × time grid of ``schedule`` (see the module docstring);
    ``split``: ``async``'s backwards as ``I`` then ``W``."""
    lists, v = _lists(schedule, num_stages, chunks, stages_per_rank, split)
    return "\n".join(draw(simulate(lists), num_stages, v, placement(schedule), chunks))


def bubble_fraction(
    schedule: str,
    num_stages: int,
    chunks: int,
    stages_per_rank: int | None = None,
    split: bool = False,
) -> float:
    """Idle share of the ranks' time with ``F = I = W = 1``, ``B = 2``; gpipe: ``(p-1)/(m+p-1)``."""
    lists, _ = _lists(schedule, num_stages, chunks, stages_per_rank, split)
    timed = timeline(lists, _COSTS)
    span = max(end for row in timed for _, end, _ in row)
    busy = sum(end - start for row in timed for start, end, _ in row)
    return 1 - busy / (num_stages * span)
