"""The zero-bubble list scheduler: ``interleaved_zb`` and ``zbv`` laid out by the passes' times.

Zero Bubble pipeline parallelism (Qi et al., 2023) splits each backward
into ``I`` (the input gradient, on the critical path) and ``W`` (the weight
gradient, which nothing downstream waits for) and lays ``W`` into what would
be idle time. :func:`best_zero_bubble` runs that rule once over every rank
(:func:`zero_bubble`) with the passes' times, or with the paper's unit
costs, and keeps whichever layout ends sooner; the executor then follows
the lists it produced. The table in :mod:`mpx.pipeline.schedules.table` says which
schedules use it and with what memory cap.
"""

from __future__ import annotations

import heapq
import math

from mpx.pipeline.errors import PipelineError, PipelineValueError
from mpx.pipeline.schedules.actions import Action, PassCosts, rank_of
from mpx.pipeline.schedules.timing import timeline

__all__ = ["best_zero_bubble", "stage_costs", "zero_bubble"]


def stage_costs(costs: PassCosts | None, n: int) -> dict[str, list[float]]:
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


def best_zero_bubble(
    p: int, m: int, v: int, style: str, limits: list[int], costs: PassCosts | None
) -> list[list[Action]]:
    """The zero-bubble layout by ``costs`` or by unit costs, whichever ends sooner
    when timed with ``costs`` (a greedy rule is not always better for knowing the
    times: on random costs the unit layout wins about one case in twelve)."""
    unit = zero_bubble(p, m, v, style, limits)
    if costs is None:
        return unit
    checked = stage_costs(costs, p * v)
    timed = zero_bubble(p, m, v, style, limits, checked)

    def span(lists: list[list[Action]]) -> float:
        return max(end for row in timeline(lists, checked) for _, end, _ in row)

    return timed if span(timed) <= span(unit) else unit


def zero_bubble(
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
    cost = stage_costs(costs, n)
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
