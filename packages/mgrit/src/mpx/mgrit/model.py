"""A performance model of a layer-parallel training step at P ranks.

The work of a step is counted from the algorithm (:func:`count`: rows stepped,
batched calls and messages of the forward and the adjoint MGRIT solve, the
linearisation and the gradient sweep, on the busiest rank), and priced with
measured costs (:class:`Costs`, :func:`costs_of`: a row of a batched call and a
single-row call of each kind, the rest of the solver per owned step, measured
in a run at one rank; one neighbour message)::

    T(P) = sum over kinds (rows * row cost + single-row calls * call cost)
           + owned steps * per-step cost (the solver's other work) + messages * t_msg

The coarsest level is solved serially, rank after rank: its ``N_L`` steps are
on the critical path at any P (one single-row call each), plus one message per
rank boundary. Everything else runs on the busiest rank's blocks in parallel.
The model covers V-cycles of :class:`~mpx.mgrit.LayerParallel` with stacked
(batched) step layers.

Example::

    work = count(256, levels=3, cfactor=4, fwd_iters=1, bwd_iters=1, size=16)
    row = dict.fromkeys(WORK_KINDS, 60e-6); single = dict.fromkeys(WORK_KINDS, 90e-6)
    seconds = predict(work, Costs(row, single, message=10e-6), size=16)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.grid import coarsening_factors, split_evenly

__all__ = ["Costs", "Work", "costs_of", "count", "predict"]


@dataclass
class Work:
    """Counts on the critical path of one training step (the busiest rank, plus the serial
    coarsest solves), keyed "forward", "adjoint", "linearize", "gradient" (see
    :data:`mpx.mgrit.WORK_KINDS`): ``rows`` stepped in batched calls, ``singles`` calls
    of one row (the coarsest level's sequential steps); ``messages`` neighbour messages
    waited for (ghost exchanges, the coarsest chain, residual and final broadcasts);
    ``owned`` the busiest rank's steps."""

    rows: dict[str, int] = field(default_factory=dict)
    singles: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    owned: int = 0


@dataclass
class Costs:
    """Measured seconds: a row of a batched call (``row``) and a single-row call
    (``single``) per kind of :class:`Work`, one neighbour message (``message``), and per
    owned step the rest of the solver's work (``per_step``: injecting, correcting,
    copying levels, stacking the weights); ``cores``: ranks beyond it share cores."""

    row: dict[str, float]
    single: dict[str, float]
    message: float
    per_step: float = 0.0
    cores: float = float(1 << 30)


class _Solve:
    """Counts of one MGRIT solve on a rank holding ``b`` coarsest intervals."""

    def __init__(self, factors: list[int], b: int, coarsest: int, size: int, ncf: int) -> None:
        self.m = [*factors, 1]
        span = math.prod(factors)
        self.n = [b * span // math.prod(factors[:lvl]) for lvl in range(len(self.m))]
        self.coarsest, self.size, self.ncf = coarsest, size, ncf
        self.holders = min(size, coarsest)  # ranks beyond the coarsest intervals hold nothing
        self.left = size > 1  # the busiest rank stands for one with a left neighbour
        self.rows = self.singles = self.messages = 0

    def _add(self, rows: int, calls: int) -> None:
        if rows <= 0:
            return
        if rows == calls:  # one row a call: priced as single-row calls
            self.singles += rows
        else:
            self.rows += rows

    def f_relax(self, lvl: int, exchange: bool) -> None:
        n, m = self.n[lvl], self.m[lvl]
        # With a left neighbour, the first interval waits for the ghost and is relaxed
        # apart: m - 1 single-row calls.
        if exchange and self.left and n // m > 1:
            self._add(m - 1, m - 1)
            self._add((m - 1) * (n // m - 1), m - 1)
        else:
            self._add((m - 1) * n // m, m - 1)
        self.messages += exchange and self.size > 1

    def coarsest_solve(self) -> None:
        # Rank after rank: every coarsest step of every rank, one single-row call each.
        self._add(self.coarsest, self.coarsest)
        self.messages += self.holders - 1

    def cycle(self, lvl: int, first: bool, reuse: bool) -> None:
        last = len(self.m) - 1
        if lvl == last:
            self.coarsest_solve()
            return
        n, m = self.n[lvl], self.m[lvl]
        if first:
            self.f_relax(lvl, exchange=False)
        for _ in range(self.ncf):
            self._add(n // m, 1)
            self.f_relax(lvl, exchange=True)
        # Restriction: the fine step at the C-points (kept from the residual if nothing
        # relaxed since) and the coarse steps.
        fresh = not (reuse and lvl == 0 and not first and self.ncf == 0)
        self._add(n // m * fresh, fresh)
        self._add(n // m, 1)
        self.cycle(lvl + 1, first=True, reuse=False)
        self.f_relax(lvl, exchange=True)

    def solve(self, iters: int) -> None:
        last = len(self.m) - 1
        if last == 0:
            self.coarsest_solve()
            self._add(self.n[0], 1)  # the residual
            return
        self.coarsest_solve()  # nested start: coarse to fine
        for lvl in range(last - 1, -1, -1):
            self.messages += self.size > 1
            if lvl > 0:
                self.cycle(lvl, first=True, reuse=False)
        for it in range(iters):
            self.cycle(0, first=it == 0, reuse=it > 0)
            self._add(self.n[0] // self.m[0], 1)  # the residual, gathered by all
            self.messages += math.ceil(math.log2(self.size)) if self.size > 1 else 0


def count(
    num_steps: int,
    levels: int,
    cfactor: int | Sequence[int],
    fwd_iters: int,
    bwd_iters: int,
    size: int,
    relax: str = "F",
    nrelax: int = 1,
    bwd_levels: int | None = None,
) -> Work:
    """The critical-path work of one forward + backward at ``size`` ranks (V-cycles,
    nested start, tol never reached: every iteration runs)."""
    bwd_levels = levels if bwd_levels is None else bwd_levels
    if relax not in ("F", "FCF"):
        raise MGRITConfigError(f'relax must be "F" or "FCF", got {relax!r}')
    ncf = nrelax if relax == "FCF" else 0
    work = Work()
    for kind, lv, iters in (("forward", levels, fwd_iters), ("adjoint", bwd_levels, bwd_iters)):
        factors = coarsening_factors(cfactor, lv)
        span = math.prod(factors)
        if num_steps % span:
            raise MGRITConfigError(
                f"num_steps={num_steps} is not a multiple of {span} (levels={lv}, "
                f"cfactor={cfactor}); use a multiple of {span} or fewer levels"
            )
        b = max(split_evenly(num_steps // span, size))
        solve = _Solve(factors, b, num_steps // span, size, ncf)
        solve.solve(iters)
        work.rows[kind], work.singles[kind] = solve.rows, solve.singles
        work.messages += solve.messages
    fine = max(split_evenly(num_steps // math.prod(coarsening_factors(cfactor, levels)), size))
    owned = fine * math.prod(coarsening_factors(cfactor, levels))
    work.owned = owned
    work.rows["linearize"] = work.rows["gradient"] = owned
    work.singles["linearize"] = work.singles["gradient"] = 0
    work.messages += 2 if size > 1 else 0  # x_N and dL/dx0 broadcast
    return work


def predict(work: Work, costs: Costs, size: int = 1) -> float:
    """Seconds of one training step at ``size`` ranks: the work priced with the costs."""
    compute = sum(
        work.rows[k] * costs.row.get(k, 0.0) + work.singles[k] * costs.single.get(k, 0.0)
        for k in work.rows
    )
    compute += work.owned * costs.per_step
    shared = max(1.0, size / costs.cores)  # more ranks than cores: each runs that much slower
    return compute * shared + work.messages * costs.message


def costs_of(
    seconds: dict[str, float], work: Work, total: float, message: float = 0.0, cores: int = 1 << 30
) -> Costs:
    """The costs measured in a run (:attr:`TimeStepper.seconds`) of ``work`` that took
    ``total`` seconds a step: per row, per single-row call, the rest per owned step."""
    row, single = {}, {}
    for kind in work.rows:
        row[kind] = seconds.get(kind, 0.0) / work.rows[kind] if work.rows[kind] else 0.0
        calls = seconds.get(f"{kind}_single_calls", 0.0)
        single[kind] = seconds.get(f"{kind}_single", 0.0) / calls if calls else 0.0
    inside = sum(v for k, v in seconds.items() if not k.endswith("_calls"))
    per_step = max(total - inside, 0.0) / work.owned if work.owned else 0.0
    return Costs(row, single, message, per_step, cores)
