"""Schedules: per stage, the order of forward (F) and backward (B) micro-batch passes.

A schedule is a small rule giving each stage its list of ops; :func:`grid` runs
those lists against the data dependencies (``F(s, j)`` needs ``F(s-1, j)``,
``B(s, j)`` needs ``B(s+1, j)``), one time unit per op, and prints the result as
a stage × time grid. The grids below are the output of ``grid(name, 3, 4)``
(``tests/test_schedule.py`` checks that they stay true).

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
"""

from __future__ import annotations

from collections.abc import Sequence

from mpx.pipeline.errors import PipelineError, PipelineValueError

__all__ = [
    "SCHEDULES",
    "Op",
    "async_ops",
    "bubble_fraction",
    "flush_ops",
    "grid",
    "max_alive",
    "simulate",
    "stage_ops",
]

Op = tuple[str, int]
"""``("F", j)`` or ``("B", j)``: a forward or backward pass of micro-batch ``j``."""

SCHEDULES = ("sequential", "gpipe", "1f1b", "async")
"""The values of ``Pipeline(schedule=...)``."""


def _check(schedule: str, stage: int, num_stages: int, chunks: int) -> None:
    if schedule not in SCHEDULES:
        raise PipelineValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise PipelineValueError(f"stage={stage} is not in [0, {num_stages}) stages")
    if chunks < 1:
        raise PipelineValueError(f"chunks={chunks} must be >= 1")


def stage_ops(schedule: str, stage: int, num_stages: int, chunks: int) -> list[Op]:
    """The ops of ``stage`` for one mini-batch of ``chunks`` micro-batches.

    For ``async`` this is the first call of a fresh pipeline (see :func:`async_ops`).
    """
    _check(schedule, stage, num_stages, chunks)
    m = chunks
    if schedule == "sequential":
        return [op for j in range(m) for op in (("F", j), ("B", j))]
    if schedule == "gpipe":
        return [("F", j) for j in range(m)] + [("B", j) for j in reversed(range(m))]
    if schedule == "1f1b":
        warmup = min(num_stages - stage - 1, m)
        ops: list[Op] = [("F", j) for j in range(warmup)]
        for i in range(m - warmup):
            ops += [("F", warmup + i), ("B", i)]
        return ops + [("B", j) for j in range(m - warmup, m)]
    return async_ops(num_stages - stage - 1, 0, 0, m)


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


def flush_ops(done_fwds: int, done_bwds: int) -> list[Op]:
    """The backwards an asynchronous stage still owes."""
    return [("B", j) for j in range(done_bwds, done_fwds)]


def simulate(ops: Sequence[Sequence[Op]]) -> list[list[Op | None]]:
    """Runs per-stage op lists against the dependencies, one time unit per op.

    Returns:
        ``rows[stage][t]``: the op stage runs at time ``t``, or None (idle).

    Raises:
        PipelineError: the lists deadlock (no stage can make progress).
    """
    p = len(ops)
    finished: dict[tuple[str, int, int], int] = {}  # (kind, stage, j) -> end time
    pos = [0] * p
    rows: list[list[Op | None]] = [[] for _ in range(p)]
    t = 0
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(ops[s]):
                rows[s].append(None)
                continue
            kind, j = ops[s][pos[s]]
            if kind == "F":
                need = [("F", s - 1, j)] if s > 0 else []
            else:
                need = [("B", s + 1, j)] if s < p - 1 else [("F", s, j)]
            if all(finished.get(d, t) < t for d in need):
                rows[s].append((kind, j))
                finished[(kind, s, j)] = t
                pos[s] += 1
                progressed = True
            else:
                rows[s].append(None)
        if not progressed:
            raise PipelineError(f"schedule deadlocks at time {t}: positions {pos}")
        t += 1
    # Trailing idle columns carry nothing.
    width = max(max((i + 1 for i, op in enumerate(r) if op is not None), default=0) for r in rows)
    return [r[:width] for r in rows]


def grid(schedule: str, num_stages: int, chunks: int) -> str:
    """The stage × time grid of ``schedule`` (see the module docstring)."""
    rows = simulate([stage_ops(schedule, s, num_stages, chunks) for s in range(num_stages)])
    cell = max(len(f"F{chunks - 1}"), 2)
    lines = []
    for s, row in enumerate(rows):
        cells = [(f"{op[0]}{op[1]}" if op else ".").ljust(cell) for op in row]
        lines.append(f"stage {s} | " + " ".join(cells).rstrip())
    return "\n".join(lines)


def bubble_fraction(schedule: str, num_stages: int, chunks: int) -> float:
    """Idle share of the grid (equal F and B times); gpipe: ``(p-1)/(m+p-1)``."""
    rows = simulate([stage_ops(schedule, s, num_stages, chunks) for s in range(num_stages)])
    total = num_stages * len(rows[0])
    return sum(op is None for r in rows for op in r) / total


def max_alive(ops: Sequence[Op]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any time."""
    alive = peak = 0
    for kind, _ in ops:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
