"""A performance model of a layer-parallel training step at P ranks: its critical path.

The model replays the algorithm on every rank at once, on the layout the solver
uses (:mod:`mpx.mgrit.solver.grid`: the fine grid split over the ranks, each coarse
level owned where its points fall), and follows the dependencies between ranks:
a ghost row waited for, an interval relaxed as a chain across ranks, the
coarsest level passed rank after rank, the residual gathered by all. Each rank
has a clock; a message sets the receiver's clock to at least the sender's plus
``t_msg``. The critical path is the path to the clock that ends last, and the
:class:`Work` on it (rows stepped in batched calls, single-row calls, messages)
is priced with measured costs (:class:`Costs`, :func:`costs_of`)::

    T(P) = sum over kinds (rows * row cost + single-row calls * call cost)
           + owned steps * per-step cost (the solver's other work) + messages * t_msg

Which path is critical depends on the costs: :func:`count` follows the path
under the costs it is given (default: a row 1, a single-row call 1.5, a
message 0.5). ``layout="fine"`` splits the fine grid in whole fine C-intervals
(MGRIT's, LayerParallel's and ParallelGRU's; every rank works at every rank count up
to N / cfactor); ``layout="coarsest"`` in whole coarsest intervals (a TimeStepper without
``fine_split``, and every network's before issue 56: ranks beyond the coarsest
intervals idle).
The model covers V-cycles of :class:`~mpx.mgrit.LayerParallel` with stacked
(batched) step layers; its forward and its adjoint solve, the linearisation and
the gradient sweep.

Example::

    work = count(1024, levels=5, cfactor=4, fwd_iters=2, bwd_iters=1, size=64)
    row = dict.fromkeys(WORK_KINDS, 60e-6); single = dict.fromkeys(WORK_KINDS, 90e-6)
    seconds = predict(work, Costs(row, single, message=10e-6), size=64)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.solver import coarsening_factors, fine_blocks

__all__ = ["LAYOUTS", "Costs", "Work", "costs_of", "count", "predict"]

#: the splits :func:`count` models: the fine split (the solver's and the networks') and
#: whole coarsest intervals (the networks' before issue 56)
LAYOUTS = ("fine", "coarsest")
_KINDS = ("forward", "adjoint", "linearize", "gradient")


@dataclass
class Work:
    """Counts on the critical path of one training step, keyed "forward", "adjoint",
    "linearize", "gradient" (see :data:`mpx.mgrit.WORK_KINDS`): ``rows`` stepped in
    batched calls, ``singles`` calls of one row (the coarsest level's sequential steps,
    chains across ranks); ``messages`` waited for on the path (ghost rows, the coarsest
    chain, residual gathers and final broadcasts, ``ceil(log2 P)`` each for the last
    two); ``owned`` the busiest rank's steps."""

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


class _Path:
    """One rank's clock and the work on the path that set it."""

    __slots__ = ("messages", "rows", "singles", "t")

    def __init__(self) -> None:
        self.t = 0.0
        self.rows = dict.fromkeys(_KINDS, 0)
        self.singles = dict.fromkeys(_KINDS, 0)
        self.messages = 0

    def copy(self) -> _Path:
        other = _Path()
        other.t, other.messages = self.t, self.messages
        other.rows, other.singles = dict(self.rows), dict(self.singles)
        return other


@dataclass
class _Level:
    """One level on every rank (as :class:`mpx.mgrit.solver.grid.Level`, for all ranks at once)."""

    m: int
    first: list[int]
    count: list[int]
    left: list[int | None]
    v_recv: list[bool] = field(default_factory=list)
    v_send: list[bool] = field(default_factory=list)

    def first_c(self, r: int) -> int:
        return self.m - self.first[r] % self.m

    def c_count(self, r: int) -> int:
        return max(0, (self.count[r] - self.first_c(r)) // self.m + 1)


def _levels(blocks: list[int], factors: list[int]) -> list[_Level]:
    starts = [0]
    for b in blocks:
        starts.append(starts[-1] + b)
    size, out, stride = len(blocks), [], 1
    for index in range(len(factors) + 1):
        first = [starts[r] // stride for r in range(size)]
        count = [starts[r + 1] // stride - first[r] for r in range(size)]
        left: list[int | None] = []
        last: int | None = None
        for r in range(size):
            left.append(last if count[r] > 0 and first[r] > 0 else None)
            last = r if count[r] > 0 else last
        m = factors[index] if index < len(factors) else 1
        out.append(_Level(m, first, count, left))
        stride *= m
    for fine, coarse in itertools.pairwise(out):
        coarse.v_recv = [
            coarse.left[r] is not None and fine.first[r] % fine.m != 0 for r in range(size)
        ]
        coarse.v_send = [False] * size
        for r in range(size):
            if coarse.v_recv[r]:
                sender = coarse.left[r]
                assert sender is not None
                coarse.v_send[sender] = True
    return out


class _Solve:
    """One MGRIT solve replayed on every rank's clock (``paths``, this solve's rank order)."""

    def __init__(
        self, levels: list[_Level], paths: list[_Path], kind: str, ncf: int, costs: Costs
    ) -> None:
        self.levels, self.paths, self.kind, self.ncf, self.costs = levels, paths, kind, ncf, costs
        self.size = len(paths)
        self.reuse = False  # the fine C-points' steps from the last residual are valid
        #: rows each rank stepped itself (its own work, on or off the critical path)
        self.done = [0] * self.size

    def call(self, r: int, rows: int) -> None:
        """A batched call of ``rows`` rows on rank ``r`` (one row: a single-row call)."""
        if rows <= 0:
            return
        p = self.paths[r]
        self.done[r] += rows
        if rows == 1:
            p.singles[self.kind] += 1
            p.t += self.costs.single.get(self.kind, 0.0)
        else:
            p.rows[self.kind] += rows
            p.t += rows * self.costs.row.get(self.kind, 0.0)

    def receive(self, p: _Path, sent: _Path) -> None:
        arrival = sent.t + self.costs.message
        if arrival > p.t:
            p.t, p.messages = arrival, sent.messages + 1
            p.rows, p.singles = dict(sent.rows), dict(sent.singles)

    def gather(self, messages: int) -> None:
        """Every rank waits for the slowest (a collective of ``messages`` rounds)."""
        if self.size == 1:
            return
        last = max(self.paths, key=lambda p: p.t).copy()
        last.t += messages * self.costs.message
        last.messages += messages
        for i in range(self.size):
            self.paths[i] = last.copy()

    @staticmethod
    def _rows(start: int, stop: int, m: int) -> int:
        return (stop - start + m - 1) // m if stop > start else 0

    def f_relax(self, lvl: int) -> None:
        """F-relaxation with its exchange, as ``MGRIT._exchange_f_relax``."""
        lv = self.levels[lvl]
        m = lv.m
        sent: list[_Path | None] = [None] * self.size
        for r, p in enumerate(self.paths):
            n = lv.count[r]
            if n == 0:
                continue
            if lvl == 0:
                self.reuse = False
            o = lv.first_c(r) - m
            early = (lv.first[r] + n) % m == 0
            if early:
                sent[r] = p.copy()
            left = lv.left[r]
            if left is None:
                for j in range(1, m):
                    self.call(r, self._rows(o + j if o + j >= 1 else o + j + m, n + 1, m))
            else:
                if lv.c_count(r) > 0:
                    for j in range(1, m):
                        self.call(r, self._rows(o + j + m, n + 1, m))
                    if not early:
                        sent[r] = p.copy()
                prior = sent[left]
                assert prior is not None
                self.receive(p, prior)
                for j in range(1, m):
                    self.call(r, int(1 <= o + j <= n))
            if sent[r] is None:
                sent[r] = p.copy()

    def c_relax(self, lvl: int) -> None:
        lv = self.levels[lvl]
        for r in range(self.size):
            self.call(r, lv.c_count(r))
        self.reuse = self.reuse and lvl != 0

    def restrict(self, lvl: int) -> None:
        lv, coarse = self.levels[lvl], self.levels[lvl + 1]
        reuse = self.reuse and lvl == 0
        sent: list[_Path | None] = [None] * self.size
        for r, p in enumerate(self.paths):
            if lv.count[r] == 0:
                continue
            if coarse.v_send[r]:
                sent[r] = p.copy()
            left = coarse.left[r]
            if coarse.v_recv[r] and left is not None:
                prior = sent[left]
                assert prior is not None
                self.receive(p, prior)
            c = lv.c_count(r)
            self.call(r, 0 if reuse else c)
            self.call(r, c)
        if lvl == 0:
            self.reuse = False

    def coarsest(self, lvl: int) -> None:
        lv = self.levels[lvl]
        sent: list[_Path | None] = [None] * self.size
        for r, p in enumerate(self.paths):
            n = lv.count[r]
            if n == 0:
                continue
            left = lv.left[r]
            if left is not None:
                prior = sent[left]
                assert prior is not None
                self.receive(p, prior)
            p.singles[self.kind] += n
            p.t += n * self.costs.single.get(self.kind, 0.0)
            self.done[r] += n
            sent[r] = p.copy()

    def cycle(self, lvl: int, first: bool) -> None:
        if lvl == len(self.levels) - 1:
            self.coarsest(lvl)
            return
        if first:
            self.f_relax(lvl)
        for _ in range(self.ncf):
            self.c_relax(lvl)
            self.f_relax(lvl)
        self.restrict(lvl)
        self.cycle(lvl + 1, first=True)
        self.f_relax(lvl)  # after the correction
        if lvl == 0:
            self.reuse = False

    def residual(self) -> None:
        lv = self.levels[0]
        for r in range(self.size):
            self.call(r, lv.c_count(r))
        self.reuse = True
        self.gather(_rounds(self.size))

    def run(self, iters: int) -> None:
        last = len(self.levels) - 1
        if last == 0:
            self.coarsest(0)
            self.residual()
            return
        self.coarsest(last)  # nested start: coarse to fine
        for lvl in range(last - 1, 0, -1):
            self.cycle(lvl, first=True)
        for it in range(iters):
            self.cycle(0, first=it == 0)
            self.residual()
        self.gather(_rounds(self.size))  # the final value (or dL/dx0) to every rank


def _rounds(size: int) -> int:
    return math.ceil(math.log2(size)) if size > 1 else 0


def _blocks(num_steps: int, spans: list[int], finest: int, size: int, layout: str) -> list[int]:
    if layout not in LAYOUTS:
        raise MGRITConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    unit = math.lcm(*spans) if layout == "coarsest" else finest
    return fine_blocks(num_steps, unit, size)


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
    *,
    layout: str = "fine",
    costs: Costs | None = None,
) -> Work:
    """The critical-path work of one forward + backward at ``size`` ranks (V-cycles,
    nested start, tol never reached: every iteration runs), on ``layout`` (see the
    module doc), following the path that is critical under ``costs``."""
    bwd_levels = levels if bwd_levels is None else bwd_levels
    if relax not in ("F", "FCF"):
        raise MGRITConfigError(f'relax must be "F" or "FCF", got {relax!r}')
    ncf = nrelax if relax == "FCF" else 0
    grids = []
    for lv in (levels, bwd_levels):
        factors = coarsening_factors(cfactor, lv)
        span = math.prod(factors)
        if num_steps % span:
            raise MGRITConfigError(
                f"num_steps={num_steps} is not a multiple of {span} (levels={lv}, "
                f"cfactor={cfactor}); use a multiple of {span} or fewer levels"
            )
        grids.append((factors, span))
    finest = grids[0][0][0] if grids[0][0] else (grids[1][0][0] if grids[1][0] else 1)
    blocks = _blocks(num_steps, [g[1] for g in grids], finest, size, layout)
    if costs is None:
        costs = Costs(dict.fromkeys(_KINDS, 1.0), dict.fromkeys(_KINDS, 1.5), message=0.5)
    paths = [_Path() for _ in range(size)]
    _Solve(_levels(blocks, grids[0][0]), paths, "forward", ncf, costs).run(fwd_iters)
    for b, p in zip(blocks, paths, strict=True):  # linearise every owned step, one call
        p.rows["linearize"] += b
        p.t += b * costs.row.get("linearize", 0.0)
    # The adjoint: the same blocks, ranks reversed.
    back = paths[::-1]
    _Solve(_levels(blocks[::-1], grids[1][0]), back, "adjoint", ncf, costs).run(bwd_iters)
    paths = back[::-1]
    for b, p in zip(blocks, paths, strict=True):
        p.rows["gradient"] += b
        p.t += b * costs.row.get("gradient", 0.0)
    last = max(paths, key=lambda p: p.t)
    return Work(dict(last.rows), dict(last.singles), last.messages, max(blocks))


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
