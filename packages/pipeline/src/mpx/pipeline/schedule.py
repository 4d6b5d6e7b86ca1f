"""Schedules as data: per rank, the list of actions one executor runs.

An :class:`Action` names a pass, its micro-batch and its (virtual) stage:
``F`` forward, ``B`` full backward, ``I`` input gradient and ``W`` weight
gradient (the Zero Bubble paper's B and W; torch.distributed.pipelining's
names, which keep ``B`` for the full backward), ``SEND_F``/``RECV_F`` and
``SEND_B``/``RECV_B`` for activations and gradients crossing to another rank,
and ``STEP`` (an optimizer step, in the asynchronous stream). Each schedule
emits the compute actions of a rank (:func:`compute_actions`);
:func:`rank_actions` adds the sends and receives; :mod:`mpx.pipeline.executor`
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

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from mpx.pipeline.errors import PipelineError, PipelineValueError

__all__ = [
    "ALIASES",
    "COMPUTE",
    "SCHEDULES",
    "SPLIT",
    "TIMED",
    "Action",
    "AsyncLayout",
    "Op",
    "PassCosts",
    "async_actions",
    "async_flush_actions",
    "async_ops",
    "bubble_fraction",
    "canonical",
    "compute_actions",
    "flush_ops",
    "grid",
    "local_stages",
    "max_alive",
    "placement",
    "rank_actions",
    "rank_of",
    "simulate",
    "stage_ops",
    "stages_per_rank",
    "timeline",
]

PassCosts = Mapping[str, Sequence[float]]
"""The time of each virtual stage's passes: ``{"F": [...], "I": [...], "W": [...]}``, one
entry per virtual stage, in any unit (see :func:`compute_actions`)."""

Op = tuple[str, int]
"""``("F", j)`` or ``("B", j)``: a forward or backward pass of micro-batch ``j``."""

SCHEDULES = (
    "sequential",
    "gpipe",
    "1f1b",
    "async",
    "interleaved_1f1b",
    "looped_bfs",
    "interleaved_zb",
    "zbv",
    "dualpipev",
)
"""The values of ``Pipeline(schedule=...)``."""

ALIASES = {
    "GPipe": "gpipe",
    "1F1B": "1f1b",
    "Interleaved1F1B": "interleaved_1f1b",
    "LoopedBFS": "looped_bfs",
    "InterleavedZeroBubble": "interleaved_zb",
    "ZBVZeroBubble": "zbv",
    "DualPipeV": "dualpipev",
}
"""torch.distributed.pipelining's schedule names (without ``Schedule``), accepted too."""

COMPUTE = ("F", "B", "I", "W")
"""The compute actions: forward, full backward, input gradient, weight gradient."""

SPLIT = ("interleaved_zb", "zbv", "dualpipev")
"""Schedules that split backwards into ``I`` and ``W``."""

TIMED = ("interleaved_zb", "zbv")
"""Schedules whose lists a list scheduler lays out by the passes' times (``costs``)."""

_VIRTUAL = ("interleaved_1f1b", "looped_bfs", "interleaved_zb")  # v >= 2 chunks, in a loop
_V_SHAPED = ("zbv", "dualpipev")  # exactly 2 chunks, in a V
_COSTS = {"F": 1, "I": 1, "W": 1, "B": 2}


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list: ``kind`` of micro-batch ``mb`` on virtual stage ``stage``.

    ``STEP`` has ``mb`` = the backwards done when it runs and ``stage`` = -1.
    """

    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"


def canonical(schedule: str) -> str:
    """The mpx name of ``schedule`` (torch's names accepted).

    Raises:
        PipelineValueError: an unknown name.
    """
    name = ALIASES.get(schedule, schedule)
    if name not in SCHEDULES:
        raise PipelineValueError(
            f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)} "
            f"(or torch's {', '.join(ALIASES)})"
        )
    return name


def placement(schedule: str) -> str:
    """``"v"`` for the V-shaped schedules, else ``"loop"``."""
    return "v" if canonical(schedule) in _V_SHAPED else "loop"


def stages_per_rank(schedule: str, requested: int | None) -> int:
    """Chunks per rank for ``schedule``: ``requested``, or its default (2 where it needs >= 2).

    Raises:
        PipelineValueError: a count the schedule cannot run.
    """
    name = canonical(schedule)
    if requested is not None and (not isinstance(requested, int) or requested < 1):
        raise PipelineValueError(f"stages_per_rank={requested!r} must be a positive int")
    if name in _V_SHAPED:
        if requested not in (None, 2):
            raise PipelineValueError(
                f"schedule={name!r} places exactly 2 chunks per rank in a V; "
                f"stages_per_rank={requested} cannot run: pass 2 (or leave it out)"
            )
        return 2
    if name in _VIRTUAL:
        v = 2 if requested is None else requested
        if v < 2:
            raise PipelineValueError(
                f"schedule={name!r} interleaves chunks: stages_per_rank={v} must be >= 2 "
                "(stages_per_rank=1 is schedule='1f1b' or 'gpipe')"
            )
        return v
    if name == "async":
        return 1 if requested is None else requested  # a loop of chunks when >= 2
    if requested not in (None, 1):
        raise PipelineValueError(
            f"schedule={name!r} runs one stage per rank; stages_per_rank={requested} needs "
            f"one of {', '.join(_VIRTUAL + _V_SHAPED)}"
        )
    return 1


def rank_of(stage: int, ranks: int, style: str) -> int:
    """The rank that runs virtual ``stage``."""
    if style == "v":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def local_stages(rank: int, ranks: int, v: int, style: str) -> list[int]:
    """The virtual stages of ``rank``, in the order of its chunks."""
    return [s for s in range(ranks * v) if rank_of(s, ranks, style) == rank]


def _check(schedule: str, stage: int, num_stages: int, chunks: int) -> str:
    name = canonical(schedule)
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise PipelineValueError(f"stage={stage} is not in [0, {num_stages}) stages")
    if chunks < 1:
        raise PipelineValueError(f"chunks={chunks} must be >= 1")
    return name


# -- the schedules ---------------------------------------------------------------


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
    :func:`async_actions`, and :func:`async_stream` for ``v >= 2``).

    Raises:
        PipelineValueError: a schedule that cannot run these sizes (named with the fix).
    """
    name = _check(schedule, rank, ranks, chunks)
    v = stages_per_rank(name, None if v == 1 else v)
    m, r, p = chunks, rank, ranks
    if name == "sequential":
        return [Action(k, j, r) for j in range(m) for k in ("F", "B")]
    if name == "gpipe":
        return [Action("F", j, r) for j in range(m)] + [
            Action("B", j, r) for j in reversed(range(m))
        ]
    if name == "1f1b":
        return _one_f_one_b(r, p, m)
    if name == "async":
        if v > 1 or split:
            return AsyncLayout(p, v, split=split).call(m)[r]
        return async_actions(p - r - 1, 0, 0, m, r)
    if name == "looped_bfs":
        mine = local_stages(r, p, v, "loop")
        fwd = [Action("F", j, s) for s in mine for j in range(m)]
        return fwd + [Action("B", j, s) for s in reversed(mine) for j in reversed(range(m))]
    if name == "interleaved_1f1b":
        return _interleaved(r, p, m, v)
    if name == "interleaved_zb":
        return _best_zero_bubble(p, m, v, "loop", _interleaved_limits(p, m, v), costs)[r]
    if name == "zbv":
        return _best_zero_bubble(p, m, 2, "v", [2 * p] * p, costs)[r]
    return _dualpipev(r, p, m)


def _one_f_one_b(r: int, p: int, m: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    ops = [Action("F", j, r) for j in range(warmup)]
    for i in range(m - warmup):
        ops += [Action("F", warmup + i, r), Action("B", i, r)]
    return ops + [Action("B", j, r) for j in range(m - warmup, m)]


def _interleaved_warmup(r: int, p: int, m: int, v: int) -> int:
    return min((p - r - 1) * 2 + (v - 1) * p, m * v)


def _interleaved(r: int, p: int, m: int, v: int) -> list[Action]:
    if m % p:
        raise PipelineValueError(
            f"schedule='interleaved_1f1b' runs micro-batches in rounds of one per rank: "
            f"chunks={m} must be a multiple of the {p} ranks"
        )

    def nth(k: int, backward: bool) -> tuple[int, int]:
        group, within = divmod(k, p * v)
        chunk = within // p
        if backward:
            chunk = v - 1 - chunk
        return chunk * p + r, group * p + within % p

    total = m * v
    warmup = _interleaved_warmup(r, p, m, v)
    ops = []
    for k in range(warmup):
        s, j = nth(k, False)
        ops.append(Action("F", j, s))
    for k in range(total - warmup):
        s, j = nth(warmup + k, False)
        sb, jb = nth(k, True)
        ops += [Action("F", j, s), Action("B", jb, sb)]
    for k in range(total - warmup, total):
        sb, jb = nth(k, True)
        ops.append(Action("B", jb, sb))
    return ops


def _interleaved_limits(p: int, m: int, v: int) -> list[int]:
    """Micro-batch chunks alive per rank in interleaved 1F1B (warm-up + 1): ZB's memory."""
    return [min(_interleaved_warmup(r, p, m, v) + 1, m * v) for r in range(p)]


def _stage_costs(costs: PassCosts | None, n: int) -> dict[str, list[float]]:
    """``costs`` checked, per kind a list over the ``n`` virtual stages (unit costs for None)."""
    if costs is None:
        return {k: [1.0] * n for k in ("F", "I", "W")}
    out = {}
    for kind in ("F", "I", "W"):
        times = list(costs.get(kind, ()))
        if len(times) != n or not all(
            isinstance(c, (int, float)) and math.isfinite(c) and c > 0 for c in times
        ):
            raise PipelineValueError(
                f"costs[{kind!r}]={times!r} must hold one positive, finite time per virtual "
                f"stage ({n} of them); pass None for the paper's unit costs"
            )
        out[kind] = [float(c) for c in times]
    return out


def _best_zero_bubble(
    p: int, m: int, v: int, style: str, limits: list[int], costs: PassCosts | None
) -> list[list[Action]]:
    """The zero-bubble layout by ``costs`` or by unit costs, whichever ends sooner
    when timed with ``costs`` (a greedy rule is not always better for knowing the
    times: on random costs the unit layout wins about one case in twelve)."""
    unit = _zero_bubble(p, m, v, style, limits)
    if costs is None:
        return unit
    checked = _stage_costs(costs, p * v)
    timed = _zero_bubble(p, m, v, style, limits, checked)

    def span(lists: list[list[Action]]) -> float:
        return max(end for row in timeline(lists, checked) for _, end, _ in row)

    return timed if span(timed) <= span(unit) else unit


def _zero_bubble(
    p: int, m: int, v: int, style: str, limits: list[int], costs: PassCosts | None = None
) -> list[list[Action]]:
    """A zero-bubble list per rank, laid out by a list scheduler over ``costs``.

    Whenever a rank is free it runs, in this order of preference: the
    input gradient ``I`` of its ready backward (the critical path; the
    deepest stage and oldest micro-batch first), a ready forward unless it
    already holds ``limits[rank]`` micro-batch chunks (forwarded, ``W`` not
    done; the deepest stage first, so micro-batches reach the loss early), or
    the oldest deferred ``W``. That is the Zero Bubble paper's rule (B first,
    W fills the bubbles, memory capped at 1F1B's), run once, here; the
    executor then follows the lists it produced.

    The times are each stage's ``F``, ``I`` and ``W`` (``costs``; the
    paper's unit costs for None). They matter: laid out with unit costs, a
    model whose ``W`` takes two thirds of an ``I`` (a transformer's, on CPU)
    idles 12-16 % of a 2-rank step where laid out with its own times it
    idles 5 % (``tests/test_schedule.py``). Every stage still runs its
    forwards, ``I`` and ``W`` in micro-batch order, so the costs change when
    things run, never what they compute. Where the cap holds every rank
    back and nothing is under way (uneven costs can fill a rank with its
    shallower chunk's forwards), the deepest ready forward goes past it.
    """
    n = p * v
    cost = _stage_costs(costs, n)
    owner = [rank_of(s, p, style) for s in range(n)]
    mine = [sorted((s for s in range(n) if owner[s] == r), reverse=True) for r in range(p)]
    never = math.inf
    done: dict[tuple[str, int, int], float] = {}  # ("F"|"I", stage, j) -> end time
    next_f = [0] * n
    next_i = [0] * n
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    alive = [0] * p
    lists: list[list[Action]] = [[] for _ in range(p)]
    free = [0.0] * p
    events: list[float] = []  # end times still ahead of t (a heap)
    t = 0.0
    left = n * m * 3

    def choose(r: int, capped: bool) -> Action | None:
        for s in mine[r]:
            j = next_i[s]
            ready = j < m and done.get(("F", s, j), never) <= t
            if ready and (s == n - 1 or done.get(("I", s + 1, j), never) <= t):
                return Action("I", j, s)
        if not capped or alive[r] < limits[r]:
            for s in mine[r]:
                j = next_f[s]
                if j < m and (s == 0 or done.get(("F", s - 1, j), never) <= t):
                    return Action("F", j, s)
        if capped and pending[r]:
            s, j = pending[r].pop(0)
            return Action("W", j, s)
        return None

    def place(r: int, act: Action) -> None:
        nonlocal left
        lists[r].append(act)
        end = t + cost[act.kind][act.stage]
        free[r] = end
        heapq.heappush(events, end)
        left -= 1
        if act.kind == "F":
            next_f[act.stage] += 1
            alive[r] += 1
            done[("F", act.stage, act.mb)] = end
        elif act.kind == "I":
            next_i[act.stage] += 1
            pending[r].append((act.stage, act.mb))
            done[("I", act.stage, act.mb)] = end
        else:
            alive[r] -= 1

    while left:
        for r in range(p):
            if free[r] <= t and (act := choose(r, capped=True)) is not None:
                place(r, act)
        while events and events[0] <= t:
            heapq.heappop(events)
        if events:  # (anything placed just now ends after t: it is among them)
            t = events[0]
            continue
        # Nothing under way and nothing placed: only the cap holds, so the deepest
        # ready forward goes past it.
        uncapped = [(a.stage, r, a) for r in range(p) if (a := choose(r, capped=False))]
        if not uncapped:
            raise PipelineError("internal: the zero-bubble layout deadlocked")
        _, r, act = max(uncapped, key=lambda found: found[:2])
        place(r, act)
    return lists


def _dualpipev(r: int, p: int, m: int) -> list[Action]:
    """DualPipeV's eight phases (DeepSeek's DualPipe README; torch's ScheduleDualPipeV)."""
    if m < 2 * p:
        raise PipelineValueError(
            f"schedule='dualpipev' needs at least 2 micro-batches per rank: chunks={m} < "
            f"2 x {p} ranks; raise chunks to {2 * p} or more"
        )
    s0, s1 = r, 2 * p - 1 - r
    ops: list[Action] = []
    nf = {s0: 0, s1: 0}
    nb = {s0: 0, s1: 0}
    deferred: list[tuple[int, int]] = []

    def fwd(s: int) -> None:
        ops.append(Action("F", nf[s], s))
        nf[s] += 1

    def bwd(s: int, split: bool) -> None:
        if split:
            ops.append(Action("I", nb[s], s))
            deferred.append((s, nb[s]))
        else:
            ops.append(Action("B", nb[s], s))
        nb[s] += 1

    def weight() -> None:
        if deferred:
            s, j = deferred.pop(0)
            ops.append(Action("W", j, s))

    for _ in range((p - r - 1) * 2):  # 1: forwards of the first chunk
        fwd(s0)
    for _ in range(r + 1):  # 2: both chunks' forwards
        fwd(s0)
        fwd(s1)
    for _ in range(p - r - 1):  # 3: I, W, F of the second chunk
        bwd(s1, True)
        weight()
        fwd(s1)
    for _ in range(m - 2 * p + r + 1):  # 4: F0 B1, F1 B0 (pairs)
        fwd(s0)
        bwd(s1, False)
        fwd(s1)
        bwd(s0, False)
    for _ in range(p - r - 1):  # 5: B1, F1 B0
        bwd(s1, False)
        fwd(s1)
        bwd(s0, False)
    split = False
    for i in range(r + 1):  # 6: B1 B0, the later half split
        if i == (r + 1) // 2 and r % 2 == 1:
            split = True
        bwd(s1, split)
        if i == (r + 1) // 2 and r % 2 == 0:
            split = True
        bwd(s0, split)
    for _ in range(p - r - 1):  # 7: W, B0
        weight()
        bwd(s0, split)
    for _ in range(r + 1):  # 8: the W still deferred
        weight()
    while deferred:
        weight()
    return ops


# -- the asynchronous stream --------------------------------------------------------


def async_ops(depth: int, done_fwds: int, done_bwds: int, total: int) -> list[Op]:
    """One call of the asynchronous schedule.

    Args:
        depth: number of stages after this one.
        done_fwds, done_bwds: passes this stage has run so far.
        total: micro-batches enqueued so far, this call's included.

    Returns:
        Forward iff ``done_fwds - done_bwds <= depth`` (while forwards are
        left), else backward; after the last forward, backwards until the rule
        would allow a forward again.
    """
    ops: list[Op] = []
    f, b = done_fwds, done_bwds
    while True:
        if f - b <= depth:
            if f == total:
                return ops
            ops.append(("F", f))
            f += 1
        else:
            ops.append(("B", b))
            b += 1


def async_actions(
    depth: int,
    done_fwds: int,
    done_bwds: int,
    total: int,
    stage: int,
    step_every: int = 0,
    split: bool = False,
) -> list[Action]:
    """:func:`async_ops` as actions of ``stage``, with a ``STEP`` after every
    ``step_every``-th backward (none for ``step_every=0``); with ``split`` each
    backward is ``I`` (its gradient goes upstream at once) then ``W``."""
    return _async_backwards(
        [(k, j) for k, j in async_ops(depth, done_fwds, done_bwds, total)],
        stage,
        step_every,
        split,
    )


def _async_backwards(ops: list[Op], stage: int, step_every: int, split: bool) -> list[Action]:
    out = []
    for kind, j in ops:
        if kind == "B" and split:
            out += [Action("I", j, stage), Action("W", j, stage)]
        else:
            out.append(Action(kind, j, stage))
        if kind == "B" and step_every and (j + 1) % step_every == 0:
            out.append(Action("STEP", j + 1, -1))
    return out


def async_flush_actions(
    done_fwds: int, done_bwds: int, stage: int, step_every: int = 0, split: bool = False
) -> list[Action]:
    """The backwards still owed (:func:`flush_ops`) as actions, with their steps and a
    last ``STEP`` for a partial accumulation."""
    out = _async_backwards(flush_ops(done_fwds, done_bwds), stage, step_every, split)
    if step_every and done_fwds % step_every:
        out.append(Action("STEP", done_fwds, -1))
    return out


class AsyncLayout:
    """The asynchronous stream over ``v`` chunks per rank (in a loop), laid out call by call.

    Every virtual stage ``s`` of the ``n = ranks·v`` is a PipeDream stage of
    its own (``depth = n − 1 − s``): it forwards micro-batch ``f`` only while
    ``f − b <= depth`` (``b`` backwards started), and its optimizer step (its
    chunk's parameters only) follows every ``step_every``-th of its
    backwards. A unit-time list scheduler over all ranks, run alike on every
    rank and continued from call to call (a rank starts its next call when it
    is done with this one, not when the slowest is), orders each rank's
    chunks: ``I`` (or ``B``) first whenever ready (deepest chunk first: the
    critical path), then a forward (deepest chunk first), then the oldest
    deferred ``W``, which thus fills what would be idle time. A chunk's ``W``
    runs before that chunk's next ``I``, so a backward always meets the steps
    of every earlier backward of its chunk (weight prediction counts them
    exactly), and a ``W`` that completes a step runs before the chunk's next
    forward (deferring it would only feed that forward older weights; a ``W``
    that only accumulates can wait). A chunk stops, as the one-chunk stream does, once its forwards
    are done and the rule would allow a forward again; the rank's deferred
    ``W`` close its call.

    Args:
        ranks, v: ranks and chunks per rank.
        split: ``I`` then ``W`` for each backward, else ``B``.

    Example::

        layout = AsyncLayout(2, 2, split=True)
        first = layout.call(4, step_every=1)  # per rank, its compute actions of call 1
        second = layout.call(8, step_every=1)  # micro-batches 4..7 enqueued
        rest = layout.call(8, step_every=1, flush=True)
    """

    def __init__(self, ranks: int, v: int, split: bool = False) -> None:
        self.p, self.v, self.n = ranks, v, ranks * v
        self.split = split
        self.f = [0] * self.n  # forwards done, per virtual stage
        self.b = [0] * self.n  # backwards (B or I) done
        self.depth = [self.n - 1 - s for s in range(self.n)]
        self.mine = [sorted(range(r, self.n, ranks), reverse=True) for r in range(ranks)]
        self.done: dict[tuple[str, int, int], int] = {}  # ("F"|"B", s, j) -> end time
        self.busy = [0] * ranks

    def counts(self) -> list[tuple[int, int]]:
        """Per virtual stage, ``(forwards, backwards)`` done."""
        return list(zip(self.f, self.b, strict=True))

    def _ready(self, kind: str, s: int, j: int, t: int) -> bool:
        count = self.f[s] if kind == "F" else self.b[s]
        return j < count and self.done.get((kind, s, j), 0) <= t

    def _finished(self, s: int, total: int, flush: bool) -> bool:
        f, b = self.f[s], self.b[s]
        return b == f if flush else f == total and f - b <= self.depth[s]

    def call(self, total: int, step_every: int = 0, flush: bool = False) -> list[list[Action]]:
        """Per rank, its compute actions of the call that brings ``total`` micro-batches
        enqueued (``flush``: only the backwards still owed, and a last partial step).

        Args:
            step_every: a ``STEP`` (``stage`` = the chunk's virtual stage, ``mb``
                = its backwards done) after every ``step_every``-th backward of
                a chunk; 0: none.

        Raises:
            PipelineError: internal: the layout did not finish.
        """
        p, n, f, b = self.p, self.n, self.f, self.b
        pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        lists: list[list[Action]] = [[] for _ in range(p)]
        over = [False] * p
        t = min(self.busy)
        limit = t + 4 * n * (total + 1) + 8
        while not all(over):
            for r in range(p):
                if over[r] or self.busy[r] > t:
                    continue
                act = self._choose(r, t, total, flush, pending[r], step_every)
                if act is None:
                    if not pending[r] and all(
                        self._finished(s, total, flush) for s in self.mine[r]
                    ):
                        over[r] = True
                    continue
                lists[r].append(act)
                self.busy[r] = t + 1
                if act.kind == "F":
                    f[act.stage] += 1
                    self.done[("F", act.stage, act.mb)] = t + 1
                elif act.kind in ("I", "B"):
                    b[act.stage] += 1
                    self.done[("B", act.stage, act.mb)] = t + 1
                    if act.kind == "I":
                        pending[r].append((act.stage, act.mb))
                every = step_every
                if act.kind in ("B", "W") and every and (act.mb + 1) % every == 0:
                    lists[r].append(Action("STEP", act.mb + 1, act.stage))
            t += 1
            if t > limit:
                raise PipelineError(f"internal: the asynchronous layout stopped at {self.counts()}")
        if flush and step_every:
            for r in range(p):  # a last partial accumulation
                for s in reversed(self.mine[r]):
                    if f[s] % step_every:
                        lists[r].append(Action("STEP", f[s], s))
        # What later calls still read: backwards from the oldest one owed on.
        oldest = min(b)
        self.done = {k: e for k, e in self.done.items() if k[2] >= oldest}
        return lists

    def _choose(
        self,
        r: int,
        t: int,
        total: int,
        flush: bool,
        pending: list[tuple[int, int]],
        step_every: int,
    ) -> Action | None:
        n, f, b = self.n, self.f, self.b
        for s in self.mine[r]:
            j = b[s]
            if self._finished(s, total, flush) or j >= f[s] or not self._ready("F", s, j, t):
                continue
            if s < n - 1 and not self._ready("B", s + 1, j, t):
                continue
            owed = [w for w in pending if w[0] == s]
            if owed:  # this chunk's last W first: its step comes before this backward
                pending.remove(owed[0])
                return Action("W", owed[0][1], s)
            return Action("I" if self.split else "B", j, s)
        if not flush:
            for s in self.mine[r]:
                j = f[s]
                if (
                    j < total
                    and j - b[s] <= self.depth[s]
                    and (s == 0 or self._ready("F", s - 1, j, t))
                ):
                    # A W that completes a step goes before the chunk's next
                    # forward: deferring it would feed that forward older weights.
                    owed = [w for w in pending if w[0] == s]
                    if owed and step_every and (owed[0][1] + 1) % step_every == 0:
                        pending.remove(owed[0])
                        return Action("W", owed[0][1], s)
                    return Action("F", j, s)
        if pending:
            s, j = pending.pop(0)
            return Action("W", j, s)
        return None


def flush_ops(done_fwds: int, done_bwds: int) -> list[Op]:
    """The backwards an asynchronous stage still owes."""
    return [("B", j) for j in range(done_bwds, done_fwds)]


def stage_ops(schedule: str, stage: int, num_stages: int, chunks: int) -> list[Op]:
    """The ``(kind, micro-batch)`` ops of ``stage`` (one stage per rank) for one mini-batch."""
    return [(a.kind, a.mb) for a in compute_actions(schedule, stage, num_stages, chunks)]


# -- sends and receives ---------------------------------------------------------------


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


# -- timing the lists ------------------------------------------------------------------


def timeline(
    lists: Sequence[Sequence[Action | Op]],
    costs: Mapping[str, float | Sequence[float]] | None = None,
) -> list[list[tuple[float, float, Action]]]:
    """Runs per-rank lists against the dependencies; per rank, ``(start, end, action)``.

    Lists of ``(kind, j)`` ops (one stage per rank) are taken as actions of
    stage = rank. Sends, receives and steps take no time; a compute action
    takes ``costs[kind]``, or ``costs[kind][stage]`` where that is a
    sequence (one time unit each for None).

    Raises:
        PipelineError: the lists deadlock (no rank can make progress).
    """
    costs = costs or {k: 1 for k in COMPUTE}

    def cost(a: Action) -> float:
        c = costs[a.kind]
        return c if isinstance(c, (int, float)) else c[a.stage]

    rows = [
        [a if isinstance(a, Action) else Action(a[0], a[1], r) for a in lst]
        for r, lst in enumerate(lists)
    ]
    rows = [[a for a in row if a.kind in COMPUTE] for row in rows]
    n = 1 + max((a.stage for row in rows for a in row), default=0)
    ready: dict[tuple[str, int, int], float] = {}  # ("F"|"G"|"I", stage, j) -> end time
    pos = [0] * len(rows)
    free = [0.0] * len(rows)
    out: list[list[tuple[float, float, Action]]] = [[] for _ in rows]
    while any(pos[r] < len(rows[r]) for r in range(len(rows))):
        progressed = False
        # The earliest rank that can start next goes first (an event simulation).
        best: tuple[float, int] | None = None
        for r, row in enumerate(rows):
            if pos[r] == len(row):
                continue
            a = row[pos[r]]
            need: list[tuple[str, int, int]] = []
            if a.kind == "F":
                need = [("F", a.stage - 1, a.mb)] if a.stage > 0 else []
            elif a.kind in ("B", "I"):
                need = [("F", a.stage, a.mb)]
                need += [("G", a.stage + 1, a.mb)] if a.stage < n - 1 else []
            else:
                need = [("I", a.stage, a.mb)]
            if all(d in ready for d in need):
                start = max([free[r], *(ready[d] for d in need)])
                if best is None or start < best[0]:
                    best = (start, r)
        if best is not None:
            start, r = best
            a = rows[r][pos[r]]
            end = start + cost(a)
            out[r].append((start, end, a))
            free[r] = end
            pos[r] += 1
            ready[(a.kind if a.kind != "B" else "G", a.stage, a.mb)] = end
            if a.kind in ("B", "I"):
                ready[("G", a.stage, a.mb)] = end
            progressed = True
        if not progressed:
            raise PipelineError(f"schedule deadlocks: positions {pos}")
    return out


def simulate(lists: Sequence[Sequence[Action | Op]]) -> list[list[Action | None]]:
    """One time unit per action: ``rows[rank][t]``, the action at time ``t`` or None (idle).

    Raises:
        PipelineError: the lists deadlock (no rank can make progress).
    """
    timed = timeline(lists)
    width = int(max((end for row in timed for _, end, _ in row), default=0))
    rows: list[list[Action | None]] = [[None] * width for _ in timed]
    for r, row in enumerate(timed):
        for start, _, a in row:
            rows[r][int(start)] = a
    return rows


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
    rows = simulate(lists)
    style = placement(schedule)

    def label(a: Action) -> str:
        if v == 1:
            return f"{a.kind}{a.mb}"
        chunk = local_stages(rank_of(a.stage, num_stages, style), num_stages, v, style)
        k = chunk.index(a.stage)
        if v == 2:  # the second chunk in lower case
            return f"{a.kind if k == 0 else a.kind.lower()}{a.mb}"
        return f"{a.kind}{a.mb}{'abcdefgh'[k]}"

    cell = max(len(f"F{chunks - 1}") + (v > 2), 2)
    lines = []
    for r, row in enumerate(rows):
        cells = [(label(a) if a else ".").ljust(cell) for a in row]
        lines.append(f"{'stage' if v == 1 else 'rank'} {r} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


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


def max_alive(ops: Sequence[Op]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any time."""
    alive = peak = 0
    for kind, _ in ops:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
