"""Reading schedules: their lists timed against the data dependencies, drawn as grids.

:func:`timeline` runs per-rank lists of actions against the dependencies
(``F(s, j)`` needs ``F(s−1, j)``, a backward of ``(s, j)`` one of
``(s+1, j)``, ``W`` its ``I``); :func:`simulate` does so one time unit per
action, and :func:`draw` prints the result as a rank × time grid (the grids
of :mod:`mpx.pipeline.schedules.table`'s docstring). :func:`stopped_grid` draws the
few steps around where a rank stopped, for the error of a call that failed
(``stopped_grid(lists, 1, Action("B", 0, 1), 3, 1, "loop", 4)`` of 1F1B's lists)::

    stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3
    stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .
                          ^^ rank 1 stopped here (1B0)
    stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from mpx.pipeline.errors import PipelineError
from mpx.pipeline.schedules.actions import COMPUTE, Action, Op, local_stages, rank_of

__all__ = ["draw", "max_alive", "simulate", "stopped_grid", "timeline"]

WINDOW = 8
""":func:`stopped_grid` shows this many steps either side of the one a rank stopped at."""


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


def draw(
    rows: Sequence[Sequence[Action | None]],
    ranks: int,
    v: int,
    style: str,
    chunks: int,
    names: Sequence[int] | None = None,
) -> list[str]:
    """The lines of a rank × time grid (``rows[rank][t]``, None where idle).

    With one chunk per rank a cell is ``F0``; with two, the rank's second
    chunk is in lower case (``f0``); with more, a letter names the chunk
    (``F0b``). ``names``: the rank of each row (default 0, 1, ...).

    Args:
        ranks, v, style: the pipeline's ranks, chunks per rank and their
            placement (``"loop"`` or ``"v"``).
        chunks: micro-batches per call (the cells' width).
    """
    names = list(range(len(rows))) if names is None else list(names)

    def label(a: Action) -> str:
        if v == 1:
            return f"{a.kind}{a.mb}"
        mine = local_stages(rank_of(a.stage, ranks, style), ranks, v, style)
        k = mine.index(a.stage)
        if v == 2:  # the second chunk in lower case
            return f"{a.kind if k == 0 else a.kind.lower()}{a.mb}"
        return f"{a.kind}{a.mb}{'abcdefgh'[k]}"

    cell = _cell(v, chunks)
    lines = []
    for name, row in zip(names, rows, strict=True):
        cells = [(label(a) if a else ".").ljust(cell) for a in row]
        lines.append(f"{'stage' if v == 1 else 'rank'} {name} | " + " ".join(cells).rstrip())
    return lines


def _cell(v: int, chunks: int) -> int:
    return max(len(f"F{chunks - 1}") + (v > 2), 2)


def stopped_grid(
    lists: Sequence[Sequence[Action]],
    rank: int,
    stopped: Action,
    ranks: int,
    v: int,
    style: str,
    chunks: int,
    timed: bool = True,
) -> str:
    """The grid of ``lists`` (every rank's compute actions, or ``rank``'s alone with
    ``timed=False``) near the ``stopped`` action of ``rank``, marked with ``^``.

    Timed lists are laid out one unit per action (:func:`simulate`); an untimed
    one is drawn in its order. At most :data:`WINDOW` steps either side are
    shown, ``...`` where the grid goes on.

    Raises:
        PipelineError: ``stopped`` is not in ``rank``'s list, or the lists deadlock.
    """
    if timed:
        rows = simulate(lists)
        row = rank
        names = list(range(len(lists)))
    else:
        rows = [list(lists[0])]
        row, names = 0, [rank]
    at = [t for t, a in enumerate(rows[row]) if a == stopped]
    if not at:
        raise PipelineError(f"internal: action {stopped} is not in rank {rank}'s list")
    first = max(0, at[0] - WINDOW)
    last = min(len(rows[row]), at[0] + WINDOW + 1)
    lines = draw([r[first:last] for r in rows], ranks, v, style, chunks, names)
    lines = [line + (" ..." if len(r) > last else "") for line, r in zip(lines, rows, strict=True)]
    cell = _cell(v, chunks)
    prefix = lines[row].index("| ") + 2
    caret = " " * (prefix + (at[0] - first) * (cell + 1)) + "^" * cell
    lines.insert(row + 1, f"{caret} rank {rank} stopped here ({stopped})")
    if first > 0:
        lines.insert(0, f"(from step {first})")
    return "\n".join(lines)


def max_alive(ops: Sequence[Op]) -> int:
    """The most micro-batches forwarded but not yet backwarded at any time."""
    alive = peak = 0
    for kind, _ in ops:
        alive += 1 if kind == "F" else -1
        peak = max(peak, alive)
    return peak
