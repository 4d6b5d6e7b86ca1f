"""MGRIT: multigrid reduction in time, FAS V- and F-cycles, time points split across ranks.

The problem is ``u_{i+1} = step(u_i, t_i, dt_i)`` for ``i = 0..nt-1`` with
``u_0`` given. MGRIT solves all time points at once: relaxation works on many
C-intervals in parallel, and a coarse grid (every ``cfactor``-th point, the
same step with the longer ``dt``) corrects the C-points (full approximation
scheme, FAS). One V-cycle on level l (l = L-1 is the coarsest)::

    F-relax            (first iteration on the fine level; always on coarse levels)
    C-relax, F-relax   (``nrelax`` times for FCF; never for F; the ghost exchange
                       overlaps the F-relaxation of all but the first interval)
    restrict           v = u at C-points; g_{l+1} = r_l(C) + v - Phi_{l+1}(v_prev)
    cycle(l+1)         (coarsest: sequential solve u_i = g_i + Phi(u_{i-1}))
    correct            u(C) += u_{l+1} - v
    F-relax            (overlapping the exchange, as above)

An F-cycle (``cycle_type="F"``, PyMGRIT's) recurses with F-cycles and, on every
level but the fine one, follows its final F-relaxation with a V-cycle on that
level that skips the first F-relaxation; with 2 levels it is the V-cycle. It
does more coarse work per iteration and converges in fewer iterations where the
coarse levels are far from the coarsest.

The residual is ``r_i = step(u_{i-1}) - u_i`` at fine C-points; its 2-norm over
all C-points (each point's 2-norm, then the 2-norm of those) is what PyMGRIT
reports, so the histories can be compared number by number. The per-point
norms are gathered in global order on every rank, so the history does not
depend on the number of ranks.

With ``skip_downcycle=True`` the first cycle does no down-cycle relaxation:
the initial guess is built coarse to fine (a solve on the coarsest grid,
injected into each finer level and improved there by one V-cycle), which is
PyMGRIT's nested iteration; iteration 1 is then a full V-cycle.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from mpx.collectives import allgather, broadcast
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.errors import MGRITTypeError
from mpx.mgrit.solver.boundaries import Boundaries
from mpx.mgrit.solver.ghosts import Ghosts, Shift, mismatch
from mpx.mgrit.solver.grid import Layout
from mpx.mgrit.solver.options import CYCLES, RELAXATIONS, check_choice, check_int, check_tol
from mpx.mgrit.solver.sequential import march, march_into, step_once

__all__ = ["MGRIT", "Ghosts", "Shift", "Step", "check_tol", "mismatch"]

#: ``step(u, t, dt) -> u``: one time step from ``t`` to ``t + dt``. With
#: ``vectorized=True``, ``u`` has a leading batch dimension of k states and
#: ``t``, ``dt`` are float64 tensors of shape (k,).
Step = Callable[[torch.Tensor, Any, Any], torch.Tensor]
"""One time step, ``step(u, t, dt) -> u``, on torch tensors."""
#: ``step_into(u, t, dt, out)``: a vectorized step written into ``out`` (rows of a level).
StepInto = Callable[[torch.Tensor, Any, Any, torch.Tensor], None]


class MGRIT:
    """Parallel-in-time solver for ``u_{i+1} = step(u_i, t_i, dt_i)`` on [t0, tf].

    Args:
        step: one time step ``step(u, t, dt) -> u`` on torch tensors (CPU or CUDA).
        t0, tf: the time interval; ``nt`` steps on ``numpy.linspace(t0, tf, nt + 1)``.
        comm: the ranks that share the time grid (default: all); an mpx Communicator or an
            mpi4py one (``MPI.COMM_WORLD``, as torchbraid takes it).
        levels: grid levels (1 = a sequential solve).
        cfactor: coarsening factor, one int or one per coarsening.
        max_iters: most cycles (iterations).
        tol: stop when the C-point residual norm is below this.
        relax: ``"FCF"`` (F, then ``nrelax`` times C and F) or ``"F"``.
        nrelax: CF sweeps after the first F sweep (FCF only).
        cycle_type: ``"V"`` or ``"F"`` (PyMGRIT's ``cycle_type``; see the module doc).
        fine_relax: the relaxation of the fine level only (``"F"`` or ``"FCF"``;
            default: ``relax``). torchbraid relaxes coarse levels with FCF and the
            fine level with F unless ``fine_fcf``: ``relax="FCF", fine_relax="F"``.
        skip_downcycle: build the initial guess coarse to fine (see the module doc).
        vectorized: ``step`` accepts a batch of states (leading dimension) with
            tensors ``t`` and ``dt``; relaxation then steps all intervals at once.
        blocks: fine time steps per rank, summing to ``nt`` (default: an even split in
            whole fine C-intervals); a rank may hold none.
        boundary_steps: where a rank's row 0 on a coarse level lies before its fine block,
            its left neighbour computes the step from that point and sends the result
            (see :mod:`mpx.mgrit.solver.boundaries`): every step then starts inside the rank's
            fine block or at its last point. Networks need it (a step is a layer);
            the history is the same either way.
        float_times: with ``vectorized``, the sequential solve on the coarsest level
            (the one loop that cannot be batched) passes ``t`` and ``dt`` as Python
            floats with a batch of one state: fewer tensor operations per step for
            steps written with broadcasting arithmetic.

    Example::

        solver = MGRIT(lambda u, t, dt: u / (1 + dt), 0.0, 5.0, nt=100)
        u_final = solver.solve(torch.ones(1, dtype=torch.float64))
        print(solver.residuals)
    """

    def __init__(
        self,
        step: Step,
        t0: float,
        tf: float,
        nt: int,
        comm: CommLike = None,
        levels: int = 2,
        cfactor: int | Sequence[int] = 2,
        max_iters: int = 10,
        tol: float = 1e-9,
        relax: str = "FCF",
        nrelax: int = 1,
        skip_downcycle: bool = True,
        vectorized: bool = False,
        blocks: Sequence[int] | None = None,
        float_times: bool = False,
        fine_relax: str | None = None,
        cycle_type: str = "V",
        boundary_steps: bool = False,
    ) -> None:
        # The checks of MGRITOptions, which the networks' settings pass through.
        check_choice(cycle_type, "cycle_type", CYCLES, " (as PyMGRIT names them)")
        check_choice(relax, "relax", RELAXATIONS)
        if fine_relax is not None:
            check_choice(fine_relax, "fine_relax", RELAXATIONS, " or None (= relax)")
        check_int(nrelax, "nrelax", 0, "CF sweeps after the first F sweep")
        check_int(max_iters, "max_iters", 1, "the most MGRIT cycles")
        if not callable(step):
            raise MGRITTypeError(f"step must be callable step(u, t, dt) -> u, got {step!r}")
        self.step = step
        self.comm = as_communicator(comm)
        self.layout = Layout(t0, tf, nt, levels, cfactor, self.comm.size, self.comm.rank, blocks)
        # Other grids on other ranks: a silent wrong solve or a hang (MPX_CHECK=0 skips it).
        self.comm.check_same("MGRIT", {
            "t0, tf, nt": (float(t0), float(tf), nt), "cfactor": tuple(self.layout.factors),
            "blocks": tuple(self.layout.blocks), "boundary_steps": bool(boundary_steps),
            "relax": (relax, nrelax, fine_relax, cycle_type, skip_downcycle),
        })  # fmt: skip
        self.nt = nt
        self.num_levels = levels
        self.max_iters = max_iters
        self.tol = check_tol(tol, "tol")
        self.ncf = nrelax if relax == "FCF" else 0
        # CF sweeps per level: the fine level may relax differently from the coarse ones.
        fine_ncf = self.ncf if fine_relax is None else (nrelax if fine_relax == "FCF" else 0)
        self.ncf_per_level = [fine_ncf] + [self.ncf] * (levels - 1)
        self.skip_downcycle = skip_downcycle
        self.cycle_type = cycle_type
        self.vectorized = vectorized
        self.float_times = float_times
        # One exchange per level (its own neighbours: the ranks that own points there),
        # all on one channel.
        self._bounds = Boundaries(self.comm, self.layout, boundary_steps)
        self._ghosts = self._bounds.ghosts
        self.ghosts = self._ghosts[0]
        #: residual norm after each iteration of the last solve
        self.residuals: list[float] = []
        self.iterations = 0
        #: seconds of the last solve: "init" (initial guess), "cycles" (V-cycles and residuals)
        self.timings: dict[str, float] = {"init": 0.0, "cycles": 0.0}
        #: with ``vectorized``, an optional ``step_into(u, t, dt, out)`` writing the step of
        #: rows ``u`` into ``out`` (other rows of the same level): no result to copy in
        self.step_into: StepInto | None = None
        # Level tensors, allocated once per (state shape, dtype, device) and reused
        # (see _setup); g and v are None on the fine level.
        self._u: list[torch.Tensor] = []
        self._g: list[torch.Tensor | None] = []
        self._v: list[torch.Tensor | None] = []
        # Per level: the steps of its C-points' predecessors (restriction, residual).
        self._scratch: list[torch.Tensor] = []
        self._key: tuple[object, ...] | None = None
        # Whether g of a level holds a restriction yet (else it is zero: not read).
        self._g_live: list[bool] = []
        # A fine-level tensor to use instead of allocating one (see detach_fine).
        self._spare: torch.Tensor | None = None
        # The fine step at the C-points from the last residual, while still valid.
        self._phi_c: torch.Tensor | None = None
        # Times per level, as Python floats (scalar steps) and as tensors (vectorized).
        self._t = [lv.times[:-1].tolist() for lv in self.layout.levels]
        self._dt = [lv.dts.tolist() for lv in self.layout.levels]
        self._tt = [torch.from_numpy(lv.times[:-1].copy()) for lv in self.layout.levels]
        self._tdt = [torch.from_numpy(lv.dts.copy()) for lv in self.layout.levels]

    # -- public ---------------------------------------------------------------

    def solve(self, u0: torch.Tensor) -> torch.Tensor:
        """Solves from ``u0`` (the same on every rank), without autograd. Collective.

        Returns:
            the value at ``tf``, on every rank.
        """
        # The iterations are not differentiated (an adjoint solve is: see mpx.mgrit.adjoint);
        # without autograd, steps with trainable parameters record no graphs.
        with torch.no_grad():
            return self._solve(u0)

    def _solve(self, u0: torch.Tensor) -> torch.Tensor:
        self._setup(u0)
        self.residuals = []
        self.iterations = 0
        if self.num_levels == 1:
            self._coarsest(0)
            self.iterations = 1
            self.residuals.append(self._residual())
        else:
            start = time.perf_counter()
            if self.skip_downcycle:
                self._nested_start()
            self.timings["init"] = time.perf_counter() - start
            start = time.perf_counter()
            for it in range(self.max_iters):
                self._cycle(0, first=it == 0, kind=self.cycle_type)
                self.iterations = it + 1
                self.residuals.append(self._residual())
                if self.residuals[-1] < self.tol:
                    break
            self.timings["cycles"] = time.perf_counter() - start
        return self.final_value()

    def final_value(self) -> torch.Tensor:
        """The value at ``tf``, broadcast from the rank that holds it. Collective."""
        u = self._u[0]
        root = self.layout.last_rank
        buf = u[-1].detach().to("cpu", copy=True).contiguous()
        if self.comm.size > 1:
            broadcast(buf, root, comm=self.comm)
        return buf.to(u.device)

    def local_solution(self) -> torch.Tensor:
        """This rank's fine points, rows in the order of :meth:`local_indices`."""
        if not self.layout.active:
            return self._u[0][:0]
        return self._u[0] if self.layout.holds_start else self._u[0][1:]

    def local_indices(self) -> range:
        """Global fine indices of :meth:`local_solution`'s rows."""
        return self.layout.fine_indices()

    def local_times(self) -> np.ndarray:
        """Times of :meth:`local_solution`'s rows."""
        times = self.layout.levels[0].times
        return times if self.layout.holds_start else times[1:]

    # -- set-up ---------------------------------------------------------------

    def _setup(self, u0: torch.Tensor) -> None:
        if not isinstance(u0, torch.Tensor):
            raise MGRITTypeError(
                f"u0 must be a torch.Tensor, got {type(u0).__name__}; "
                "convert it with torch.as_tensor(u0)"
            )
        self._phi_c = None
        if self._tt[0].device != u0.device:
            # Vectorized steps get t and dt on the state's device.
            self._tt = [t.to(u0.device) for t in self._tt]
            self._tdt = [t.to(u0.device) for t in self._tdt]
        key = (tuple(u0.shape), u0.dtype, u0.device)
        if key != self._key or not self._u:
            self._allocate(u0)
            self._key = key
        elif self._u[0].shape[0] == 0:  # handed over by detach_fine
            self._u[0] = self._fine_tensor(u0)
        self._g_live = [False] * self.num_levels
        # Only what is read before it is written needs a value: the ghost rows, and the
        # fine level's initial guess without the nested start (which injects the
        # C-points and relaxes the F-points first). g is zero until restricted (_g_live).
        if self.num_levels > 1 and not self.skip_downcycle:
            self._u[0].zero_()
        # Row 0 of a level whose block starts at t0 is u0 (never relaxed, on any rank);
        # elsewhere it is a ghost, zero until exchanged.
        for u, lv in zip(self._u, self.layout.levels, strict=True):
            if lv.first == 0:
                u[0] = u0
            else:
                u[0].zero_()
        # A stepped row 0 that is t0 (see mpx.mgrit.solver.boundaries): step(u0) of that level.
        self._bounds.t0_steps(
            lambda lvl: self._step_from(u0, self.layout.t0, self._bounds.first_dt[lvl]),
            [u[0] for u in self._u],
        )

    def _allocate(self, u0: torch.Tensor) -> None:
        self._u, self._g, self._v, self._scratch = [], [], [], []
        for lv in self.layout.levels:
            shape = (lv.count + 1, *u0.shape)
            u = self._fine_tensor(u0) if lv.index == 0 else u0.new_empty(shape)
            self._u.append(u)
            self._g.append(None if lv.index == 0 else torch.empty_like(u))
            self._v.append(None if lv.index == 0 else torch.empty_like(u))
            self._scratch.append(u0.new_empty((lv.c_count, *u0.shape)))

    def _fine_tensor(self, u0: torch.Tensor) -> torch.Tensor:
        """The fine level's tensor: the spare one handed back, if it fits, or a new one."""
        shape = (self.layout.levels[0].count + 1, *u0.shape)
        spare, self._spare = self._spare, None
        if spare is not None and (spare.shape, spare.dtype, spare.device) == (
            shape,
            u0.dtype,
            u0.device,
        ):
            return spare
        return u0.new_empty(shape)

    def detach_fine(self) -> torch.Tensor:
        """Hands the fine level's tensor (the last solve's solution) over to the caller.

        The solver no longer writes it: the next solve takes a tensor given to
        :meth:`reuse_fine`, else a new one. The adjoint keeps the forward states
        so, without copying them.
        """
        u = self._u[0]
        self._u[0] = u.new_empty((0, *u.shape[1:]))
        return u

    def reuse_fine(self, spare: torch.Tensor) -> None:
        """Gives back a tensor of :meth:`detach_fine` that its holder is done with, for
        the next solve that needs a fine level (used if its shape, dtype and device fit)."""
        self._spare = spare

    def _nested_start(self) -> None:
        last = self.num_levels - 1
        self._coarsest(last)
        for lvl in range(last - 1, -1, -1):
            lv = self.layout.levels[lvl]
            self._u[lvl][lv.first_c :: lv.cfactor] = self._u[lvl + 1][1:]
            # The ghost row is refreshed by the F-relaxation that comes first on this level.
            if lvl > 0:
                self._cycle(lvl, first=True)

    # -- kernels --------------------------------------------------------------

    def _phi(self, lvl: int, start: int, stop: int, stride: int) -> torch.Tensor:
        """The step applied to rows ``start:stop:stride`` of level ``lvl``."""
        u = self._u[lvl]
        if self.vectorized:
            sl = slice(start, stop, stride)
            return self.step(u[sl], self._tt[lvl][sl], self._tdt[lvl][sl])
        t, dt, step = self._t[lvl], self._dt[lvl], self.step
        return torch.stack([step(u[i], t[i], dt[i]) for i in range(start, stop, stride)])

    def _phi_into(self, lvl: int, start: int, stop: int, stride: int, out: torch.Tensor) -> Any:
        """The step of rows ``start:stop:stride``, written into ``out`` with ``step_into``
        (else a new tensor). A stepped row 0 is its own step (see :mod:`.boundaries`)."""
        if start == 0 and self._bounds.stepped[lvl]:
            first = self._u[lvl][0:1]
            if stop <= stride:
                return out.copy_(first) if self.step_into is not None else first.clone()
            if self.step_into is None:
                return torch.cat([first, self._phi(lvl, stride, stop, stride)])
            out[0] = first[0]
            self._phi_into(lvl, stride, stop, stride, out[1:])
            return out
        if self.step_into is None:
            return self._phi(lvl, start, stop, stride)
        sl = slice(start, stop, stride)
        self.step_into(self._u[lvl][sl], self._tt[lvl][sl], self._tdt[lvl][sl], out)
        return out

    def _live_g(self, lvl: int) -> torch.Tensor | None:
        """g of level ``lvl``, or None while it is zero (no restriction yet this solve)."""
        return self._g[lvl] if self._g_live[lvl] else None

    def _relax_rows(self, lvl: int, start: int, stop: int, m: int) -> None:
        """``u_i = g_i + Phi(u_{i-1})`` for rows ``start:stop:m``, written in place."""
        u, g = self._u[lvl], self._live_g(lvl)
        if start == 1 and self._bounds.stepped[lvl]:
            # Row 0 holds the left neighbour's step from its point: row 1 = g_1 + it.
            if g is None:
                u[1] = u[0]
            else:
                torch.add(g[1], u[0], out=u[1])
            start += m
            if start >= stop:
                return
        rows = u[start:stop:m]
        if self.step_into is not None:
            src = slice(start - 1, stop - 1, m)
            self.step_into(u[src], self._tt[lvl][src], self._tdt[lvl][src], rows)
            if g is not None:
                rows.add_(g[start:stop:m])
            return
        new = self._phi(lvl, start - 1, stop - 1, m)
        if g is None:
            rows.copy_(new)
        else:
            torch.add(g[start:stop:m], new, out=rows)

    def _f_relax(self, lvl: int, lead: bool = True, rest: bool = True) -> None:
        """F-relaxation of this rank's F-points of level ``lvl``.

        ``lead``: the leading ones, before the first owned C-point (they step from the
        ghost row 0); ``rest``: those of the intervals that start at an owned C-point::

            rows  [g | F F C F F F C F ]      (cfactor 4; row 0 may be an F-point)
                     lead  '-- rest --'
        """
        if lvl == 0:
            self._phi_c = None
        lv = self.layout.levels[lvl]
        n, m = lv.count, lv.cfactor
        if n == 0 or m == 1:
            return
        o = lv.first_c - m  # the row of the C-point that starts the leading interval (<= 0)
        for j in range(1, m):
            start = o + j if lead and o + j >= 1 else o + j + m
            stop = n + 1 if rest else min(o + j + 1, n + 1)
            if start < stop:
                self._relax_rows(lvl, start, stop, m)

    def _exchange_f_relax(self, lvl: int) -> None:
        """F-relaxation with the ghost exchange, overlapped where the dependencies allow.

        The last row goes right as soon as it is final: a C-point at once, an F-point
        after the intervals that do not need the ghost. The leading F-points wait for
        the ghost; a rank that owns no C-point relaxes all its points after it, then
        passes its last one on (an interval crossing ranks is relaxed as a chain)::

            [g | F F C | F F F C | F F ]   the rest at once; the lead after g arrives
        """
        lv = self.layout.levels[lvl]
        if lv.count == 0:
            return
        u, ghosts = self._u[lvl], self._ghosts[lvl]
        early = lv.ends_on_c
        incoming = ghosts.start(self._outgoing(lvl) if early else None, u[0], tag=lvl)
        if not incoming.receives:  # row 0 is t0: nothing to wait for
            self._f_relax(lvl)
            if not early:
                ghosts.start(self._outgoing(lvl), None, tag=lvl).finish()
            incoming.finish()
            return
        late = None
        if lv.c_count > 0:
            self._f_relax(lvl, lead=False)
            if not early:
                late = ghosts.start(self._outgoing(lvl), None, tag=lvl)
        incoming.finish()
        self._f_relax(lvl, rest=False)
        if late is None and not early:
            late = ghosts.start(self._outgoing(lvl), None, tag=lvl)
        if late is not None:
            late.finish()

    def _c_relax(self, lvl: int) -> None:
        """C-relaxation: each owned C-point from the F-point before it (maybe the ghost row,
        which the F-relaxation before this one refreshed)."""
        if lvl == 0:
            self._phi_c = None
        lv = self.layout.levels[lvl]
        if lv.c_count == 0:
            return
        self._relax_rows(lvl, lv.first_c, lv.count + 1, lv.cfactor)

    def _restrict(self, lvl: int) -> None:
        """FAS: inject u to the coarse level and form its right-hand side g (in place)."""
        u, g = self._u[lvl], self._live_g(lvl)
        lv = self.layout.levels[lvl]
        n, m, c = lv.count, lv.cfactor, lv.first_c
        v, gc = self._v[lvl + 1], self._g[lvl + 1]
        assert v is not None
        assert gc is not None
        if n == 0:
            return
        v[1:] = u[c::m]
        self._restricted_ghost(lvl, u, v)
        self._u[lvl + 1].copy_(v)
        if lv.c_count == 0:
            return
        scratch = self._scratch[lvl]
        # The residual of the last iteration stepped the same points (F-relaxation only).
        if lvl == 0 and self._phi_c is not None:
            fine = self._phi_c
        else:
            fine = self._phi_into(lvl, c - 1, n, m, scratch)
        self._phi_c = None
        # Operation order as in PyMGRIT, so that the histories agree to rounding:
        # g_c = ((g - u) + fine + v) - coarse, each operation written into g_c.
        rhs = gc[1:]
        if g is None:
            torch.sub(fine, u[c::m], out=rhs)
        else:
            torch.sub(g[c::m], u[c::m], out=rhs)
            rhs.add_(fine)
        rhs.add_(v[1:])
        rhs.sub_(self._phi_into(lvl + 1, 0, lv.c_count, 1, scratch))  # fine is spent: reuse
        self._g_live[lvl + 1] = True

    def _restricted_ghost(self, lvl: int, u: torch.Tensor, v: torch.Tensor) -> None:
        """v's row 0: the injected value of the coarse point before the owned ones. It is
        here when row 0 of ``lvl`` is a C-point (the ghost, current since the last
        F-relaxation) or when it is t0 on the coarse level (whose row 0 stays u0); else the
        coarse level's left neighbour injected it, and sends it (or the step from it)."""
        lv = self.layout.levels[lvl]
        recv, send = self._bounds.v_recv[lvl + 1], self._bounds.v_send[lvl + 1]
        if not recv:  # t0 (or its step) on the coarse level, else row 0 here is that point
            v[0] = self._u[lvl + 1][0] if lv.first // lv.cfactor == 0 else u[0]
        if recv or send:
            last = self._outgoing(lvl + 1, v[-1]) if send else None
            self._ghosts[lvl + 1].start(last, v[0] if recv else None, tag=lvl + 1).finish()

    def _outgoing(self, lvl: int, row: torch.Tensor | None = None) -> torch.Tensor:
        """What goes right from this rank's last row of ``lvl``: the row, or the step from it
        where the right neighbour's row 0 is stepped (see :mod:`mpx.mgrit.solver.boundaries`)."""
        row = self._u[lvl][-1] if row is None else row
        if not self._bounds.sends_steps[lvl]:
            return row
        return self._step_from(row, self._bounds.last_time[lvl], self._bounds.last_dt[lvl])

    def _step_from(self, row: torch.Tensor, t: float, dt: float) -> torch.Tensor:
        """One step of one state from time ``t``, in the form the step takes."""
        return step_once(self.step, self.step_into, self.vectorized, row, t, dt)

    def _correct(self, lvl: int) -> None:
        lv = self.layout.levels[lvl]
        v = self._v[lvl + 1]
        assert v is not None
        if lv.c_count > 0:
            # u(C) += u_c - v, the difference formed in v (which this correction spends).
            diff = v[1:]
            torch.sub(self._u[lvl + 1][1:], diff, out=diff)
            self._u[lvl][lv.first_c :: lv.cfactor].add_(diff)
        if lvl == 0:
            self._phi_c = None

    def _coarsest(self, lvl: int) -> None:
        """Sequential solve, passed from rank to rank: u_i = g_i + Phi(u_{i-1})."""
        u, g = self._u[lvl], self._live_g(lvl)
        n = self.layout.levels[lvl].count
        if n == 0:
            return
        ghosts = self._ghosts[lvl]
        ghosts.start(None, u[0], tag=lvl).finish()
        begin = 0
        if self._bounds.stepped[lvl]:  # row 0 is the left's step: row 1 = g_1 + it
            self._relax_rows(lvl, 1, 2, 1)
            begin = 1
        ts, dts = self._step_times(lvl)
        if self.step_into is not None:
            march_into(self.step_into, ts, dts, u, g, n, begin)
        else:
            u[1 + begin :] = march(self.step, self.vectorized, ts, dts, u[begin], g, n, begin)
        ghosts.start(self._outgoing(lvl), None, tag=lvl).finish()

    def _step_times(self, lvl: int) -> tuple[Sequence[Any], Sequence[Any]]:
        """Each step's time and step size on ``lvl``: floats (scalar steps, ``float_times``),
        or one-element tensor rows."""
        if self.float_times or not self.vectorized:
            return self._t[lvl], self._dt[lvl]
        return self._tt[lvl].view(-1, 1).unbind(0), self._tdt[lvl].view(-1, 1).unbind(0)

    def _cycle(self, lvl: int, first: bool, kind: str = "V") -> None:
        """One cycle on level ``lvl``; ``first``: begin with an F-relaxation (PyMGRIT's first_f)."""
        if lvl == self.num_levels - 1:
            self._coarsest(lvl)
            return
        if first:
            self._exchange_f_relax(lvl)
        for _ in range(self.ncf_per_level[lvl]):
            self._c_relax(lvl)
            self._exchange_f_relax(lvl)
        self._restrict(lvl)
        self._cycle(lvl + 1, first=True, kind=kind)
        self._correct(lvl)
        self._exchange_f_relax(lvl)
        if kind == "F" and lvl > 0:
            # The F-cycle's second visit: a V-cycle from the relaxed state (the exchange
            # above already refreshed the ghost row, so no F-relaxation first).
            self._cycle(lvl, first=False, kind="V")

    def _residual(self) -> float:
        """2-norm over fine C-points of ``step(u_{c-1}) - u_c``, the same on every rank."""
        lv = self.layout.levels[0]
        n, m, c = lv.count, lv.cfactor, lv.first_c
        if lv.c_count > 0:
            fine = self._phi_into(0, c - 1, n, m, self._scratch[0])
            # Kept for the next restriction, unless relaxation changes level 0 first.
            self._phi_c = fine
            r = fine - self._u[0][c::m]
            flat = r.reshape(r.shape[0], -1)
            local = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float64).cpu()
        else:
            local = torch.zeros(0, dtype=torch.float64)
        if self.comm.size > 1:
            # Every rank's norms in rank order: rank r has counts[r] C-points (the
            # layout says how many), sent padded to the longest.
            counts = self._residual_counts()
            assert local.numel() == counts[self.comm.rank], (local.numel(), counts)
            padded = torch.zeros(max(counts), dtype=torch.float64)
            padded[: local.numel()] = local
            every = allgather(padded, comm=self.comm)
            local = torch.cat([every[r, :c] for r, c in enumerate(counts)])
        return float(np.linalg.norm(local.numpy()))

    def _residual_counts(self) -> list[int]:
        """C-points of the finest level held by each rank (its rows of the residual)."""
        return self.layout.c_counts(0)
