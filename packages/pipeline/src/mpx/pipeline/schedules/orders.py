"""Each schedule's generator: a rank's compute actions for one call.

:mod:`mpx.pipeline.schedules.table`'s table names one generator per schedule; each
takes a :class:`Shape` (the rank, the ranks, the micro-batches, the chunks
per rank, a split backward, the passes' times) and returns the rank's
compute actions in order. The fixed rules (GPipe, 1F1B, interleaved 1F1B,
looped BFS, DualPipeV) are written out here; the zero-bubble schedules ask
the list scheduler (:mod:`mpx.pipeline.schedules.zero_bubble`), ``async`` the stream
(:mod:`mpx.pipeline.schedules.async_layout`).
"""

from __future__ import annotations

from dataclasses import dataclass

from mpx.pipeline.errors import PipelineValueError
from mpx.pipeline.schedules.actions import Action, PassCosts, local_stages
from mpx.pipeline.schedules.async_layout import AsyncLayout, async_actions
from mpx.pipeline.schedules.zero_bubble import best_zero_bubble

__all__ = [
    "Shape",
    "async_stream",
    "dualpipev",
    "gpipe",
    "interleaved_1f1b",
    "interleaved_zb",
    "looped_bfs",
    "one_f_one_b",
    "sequential",
    "zbv",
]


@dataclass(frozen=True)
class Shape:
    """What a generator lays out: ``rank`` of ``ranks``, ``chunks`` micro-batches,
    ``v`` chunks per rank, ``split`` (``async``: each backward as ``I`` then ``W``)
    and ``costs`` (the zero-bubble schedules: the passes' times; None: unit costs)."""

    rank: int
    ranks: int
    chunks: int
    v: int = 1
    split: bool = False
    costs: PassCosts | None = None


def sequential(x: Shape) -> list[Action]:
    """One micro-batch at a time: its forward, then its backward."""
    return [Action(k, j, x.rank) for j in range(x.chunks) for k in ("F", "B")]


def gpipe(x: Shape) -> list[Action]:
    """Every forward, then every backward, the last micro-batch first."""
    m, r = x.chunks, x.rank
    return [Action("F", j, r) for j in range(m)] + [Action("B", j, r) for j in reversed(range(m))]


def one_f_one_b(x: Shape) -> list[Action]:
    """PipeDream-flush: warm-up forwards, then one forward and one backward in turn."""
    return _one_f_one_b(x.rank, x.ranks, x.chunks)


def async_stream(x: Shape) -> list[Action]:
    """The first call of a fresh asynchronous stream."""
    if x.v > 1 or x.split:
        return AsyncLayout(x.ranks, x.v, split=x.split).call(x.chunks)[x.rank]
    return async_actions(x.ranks - x.rank - 1, 0, 0, x.chunks, x.rank)


def looped_bfs(x: Shape) -> list[Action]:
    """Each chunk's forwards before the next chunk's; backwards chunk by chunk in reverse."""
    m = x.chunks
    mine = local_stages(x.rank, x.ranks, x.v, "loop")
    fwd = [Action("F", j, s) for s in mine for j in range(m)]
    return fwd + [Action("B", j, s) for s in reversed(mine) for j in reversed(range(m))]


def interleaved_1f1b(x: Shape) -> list[Action]:
    """Megatron's interleaved 1F1B over ``v`` chunks in a loop."""
    return _interleaved(x.rank, x.ranks, x.chunks, x.v)


def interleaved_zb(x: Shape) -> list[Action]:
    """Zero bubble over chunks in a loop, memory capped at interleaved 1F1B's."""
    p, m, v = x.ranks, x.chunks, x.v
    return best_zero_bubble(p, m, v, "loop", _interleaved_limits(p, m, v), x.costs)[x.rank]


def zbv(x: Shape) -> list[Action]:
    """ZB-V: two chunks in a V, at most ``2p`` micro-batch chunks alive per rank."""
    p = x.ranks
    return best_zero_bubble(p, x.chunks, 2, "v", [2 * p] * p, x.costs)[x.rank]


def dualpipev(x: Shape) -> list[Action]:
    """DeepSeek's DualPipeV: two chunks in a V, eight phases per rank."""
    return _dualpipev(x.rank, x.ranks, x.chunks)


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
