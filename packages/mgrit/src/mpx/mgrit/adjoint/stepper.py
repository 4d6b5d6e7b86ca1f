"""Differentiating through an MGRIT solve: the adjoint is a second MGRIT solve, backwards.

For ``x_{k+1} = phi_k(x_k)`` (k = 0..N-1) and a loss of ``x_N``, the adjoint
``lam_k = dL/dx_k`` satisfies ``lam_k = J_k^T lam_{k+1}``, ``J_k = d phi_k / dx``,
from ``lam_N = dL/dx_N``. In reversed time ``j = N - k`` that is again a forward
time-stepping problem, solved by MGRIT on the same levels; its step from
reversed point j is the vector-Jacobian product of step ``N-1-j`` at the stored
forward state. Each layer stays on the rank that holds it: the adjoint solver
runs on the communicator with ranks in reverse order and the blocks reversed::

    forward   rank 0: x_0..x_a   rank 1: x_a..x_b   rank 2: x_b..x_N     --> time
    adjoint   rank 2: lam_N..lam_b   rank 1: lam_b..lam_a   rank 0: lam_a..lam_0

The gradients of parameters (and of other inputs of the steps) are
accumulated in one final fine sweep over the converged adjoint: for every
local step, ``grad += (d phi_k / d theta)^T lam_{k+1}``.
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Unpack

import torch

from mpx.collectives import broadcast
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.adjoint.gru_steps import GRUSteps
from mpx.mgrit.adjoint.halo import StateHalo
from mpx.mgrit.adjoint.stacked import StackedSteps
from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.solver import (
    MGRIT,
    MGRITOptions,
    MGRITSettings,
    check_int,
    coarsening_factors,
    fine_blocks,
    resolve,
)

__all__ = ["WORK_KINDS", "Lease", "TimeStepper", "shared_blocks"]

# What TimeStepper.work counts, in layer evaluations (one step of one state).
WORK_KINDS = ("forward", "adjoint", "linearize", "gradient")
"""The kinds of layer evaluation :func:`mpx.mgrit.work` counts: "forward" the steps of
the forward solve, "adjoint" the vector-Jacobian products (with respect to the state)
of the adjoint solve, "linearize" the forward evaluations the backward makes to
differentiate, "gradient" the vector-Jacobian products with respect to the parameters
of the final sweep."""

#: ``phi(k, x, dt) -> x``: step k of the network from state x, with step size dt.
Phi = Callable[[int, torch.Tensor, float], torch.Tensor]
#: ``inputs(k)`` -> indices (into the tensors given to the autograd function) that step k uses.
Uses = Callable[[int], Sequence[int]]


def shared_blocks(
    num_steps: int,
    cfactor: int | Sequence[int],
    fwd_levels: int,
    bwd_levels: int,
    size: int,
    fine: bool = False,
) -> tuple[list[int], list[int]] | None:
    """Fine steps per rank of the forward and of the adjoint grid, in forward rank order.

    A step's layer lives on one rank, so both solves give every rank the same
    fine steps. A network's coarse step from a point uses the layer (and, in the
    adjoint, the forward state) *at* that point. Without ``fine`` (a step that reads
    nothing of its neighbours) the blocks are whole coarsest intervals of both grids
    (their least common multiple), so that every such step finds its layer on the rank
    that computes it. With ``fine`` (LayerParallel and ParallelGRU, which carry their
    neighbours' boundary layers or input rows, :mod:`mpx.mgrit.adjoint.halo`) the split is the
    solver's: whole fine C-intervals.
    """
    spans = []
    for levels, name in ((fwd_levels, "fwd_levels"), (bwd_levels, "bwd_levels")):
        depth = check_int(levels, name, 1, "1 = a sequential solve")
        spans.append(math.prod(coarsening_factors(cfactor, depth)))
    unit = math.lcm(*spans)
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps % unit != 0:
        if spans[0] == spans[1]:
            return None  # one grid: the solver's own message says what fits
        raise MGRITConfigError(
            f"num_steps={num_steps!r} cannot be split into whole coarsest intervals of both "
            f"the forward grid (fwd_levels={fwd_levels}: {spans[0]} steps each) and the "
            f"adjoint grid (bwd_levels={bwd_levels}: {spans[1]} steps each); every coarse "
            f"point must be a fine point. Use num_steps a multiple of {unit}, or fewer levels"
        )
    if fine:
        deepest = max(fwd_levels, bwd_levels)
        unit = coarsening_factors(cfactor, deepest)[0] if deepest > 1 else 1
    blocks = fine_blocks(num_steps, unit, size)
    return blocks, list(blocks)


class Lease:
    """Held by whoever reads a forward solve's states (an autograd context).

    The states are the forward solver's fine level itself, not a copy: when the
    lease is gone (the graph freed after its backward, or never built), the
    next forward solve writes that tensor again instead of allocating one.
    """

    __slots__ = ("__weakref__",)


class TimeStepper:
    """Forward MGRIT and adjoint MGRIT for ``x_{k+1} = phi(k, x_k, h)``, k = 0..N-1.

    Args:
        phi: the step; on coarse levels it is called with ``dt = h * stride``.
        uses: for step k, which of the differentiable tensors it reads.
        comm: the ranks of the forward solve; the adjoint runs on a communicator split
            off it with the ranks reversed, which :meth:`close` frees.
        options: the MGRIT settings of both solves (:class:`~mpx.mgrit.MGRITOptions`),
            or as keywords (``**settings``: ``levels=3, fwd_iters=4, ...``), not both;
            the forward and the adjoint solve may use different grids and stop at
            different residuals (``fwd_levels``/``bwd_levels``, ``fwd_tol``/``bwd_tol``).
        blocks: fine steps per rank of the forward and of the adjoint grid, in
            this communicator's rank order (default: :func:`shared_blocks`); a reversed
            copy of another stepper's blocks puts its steps on the mirrored ranks.

    Example::

        ts = TimeStepper(phi, uses, num_steps=16, Tf=1.0, levels=2)
        xN = ts.apply(x0, tensors)     # differentiable, on every rank
        xN.sum().backward()
        ts.close()                     # collective: frees the adjoint's communicator
    """

    #: the settings a TimeStepper made without ``options=`` starts from
    defaults = MGRITOptions()

    def __init__(
        self,
        phi: Phi,
        uses: Uses,
        num_steps: int,
        Tf: float,
        comm: CommLike = None,
        *,
        options: MGRITOptions | None = None,
        blocks: tuple[Sequence[int], Sequence[int]] | None = None,
        fine_split: bool = False,
        **settings: Unpack[MGRITSettings],
    ) -> None:
        self.phi, self.uses = phi, uses
        #: the MGRIT settings of both solves
        self.options = opts = resolve("TimeStepper", options, settings, self.defaults)
        self.comm = as_communicator(comm)
        self.N, self.h = num_steps, float(Tf) / num_steps
        shared = shared_blocks(
            num_steps, opts.cfactor, opts.forward_levels, opts.adjoint_levels, self.comm.size,
            fine=fine_split,
        )  # fmt: skip
        if blocks is not None:
            shared = (list(blocks[0]), list(blocks[1]))
        fwd_blocks, bwd_blocks = (None, None) if shared is None else shared
        both: dict[str, Any] = {
            "cfactor": opts.cfactor,
            "relax": opts.relax,
            "nrelax": opts.nrelax,
            "skip_downcycle": opts.skip_downcycle,
            "fine_relax": opts.fine_relax,
            "cycle_type": opts.cycle_type,
            "boundary_steps": fine_split,
        }
        self.fwd = MGRIT(
            self._step, 0.0, Tf, num_steps, self.comm, levels=opts.forward_levels,
            max_iters=opts.fwd_iters, tol=opts.forward_tol, blocks=fwd_blocks, **both,
        )  # fmt: skip
        reverse = self.comm.split(0, key=self.comm.size - 1 - self.comm.rank)
        assert reverse is not None
        #: the adjoint's communicator: this solver's own (split off ``comm``), freed by close()
        self.rcomm = reverse
        self._closed = False
        try:
            self.bwd = MGRIT(
                self._adjoint_step, 0.0, Tf, num_steps, reverse, levels=opts.adjoint_levels,
                max_iters=opts.bwd_iters, tol=opts.adjoint_tol,
                blocks=self.fwd.layout.blocks[::-1] if bwd_blocks is None else bwd_blocks[::-1],
                **both,
            )  # fmt: skip
        except MGRITConfigError:
            # A bad grid is bad on every rank (the same settings everywhere): all free it.
            self.close()
            raise
        lv = self.fwd.layout.levels[0]
        #: the steps (layers) this rank computes: k in [first, stop)
        self.first, self.stop = lv.first, lv.first + lv.count
        self._states: torch.Tensor | None = None
        self._forcing: torch.Tensor | None = None
        # The forward states handed out, with their leases (see Lease).
        self._leased: list[tuple[torch.Tensor, weakref.ref[Lease]]] = []
        #: layer evaluations (rows stepped) of this rank in the last forward and the last
        #: backward: see :data:`WORK_KINDS`
        self.work: dict[str, int] = dict.fromkeys(WORK_KINDS, 0)
        self.stacked: StackedSteps | GRUSteps | None = None
        #: the neighbours' boundary layers and state (fine split; see :meth:`use_halo`)
        self.halo: StateHalo | None = None
        #: seconds of the last forward and backward inside the stacked steps, per kind,
        #: batched calls apart from single-row ones (``"forward_single"``...): the costs
        #: the performance model (:mod:`mpx.mgrit.model`) prices the work with (CPU)
        self.seconds: dict[str, float] = {}

    def close(self) -> None:
        """Frees the communicator this solver split off. Collective, idempotent.

        Every rank of ``comm`` calls it (MPI frees communicators collectively, so
        never from a finalizer); a second call does nothing. The ``comm`` it was
        given stays. Afterwards a solve raises :class:`~mpx.mgrit.MGRITConfigError`.
        """
        if self._closed:
            return
        self._closed = True
        self.rcomm.free()

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def check_open(self, owner: str = "this TimeStepper") -> None:
        """Raises MGRITConfigError naming ``owner`` and close() once it is closed."""
        if self._closed:
            raise MGRITConfigError(
                f"{owner} was closed: close() freed its MGRIT communicators, so it cannot "
                "solve any more; build a new one (and close() it when done)"
            )

    def use_halo(self, halo: StateHalo) -> None:
        """Refreshes ``halo`` before each forward solve and shares the state before the
        block (and, in :meth:`adjoint`, the source there) before each adjoint solve: on
        the fine split ``phi`` is called for steps ``first - 1`` (adjoint) and ``stop``
        (forward) too, whose layers (a :class:`~mpx.mgrit.adjoint.halo.LayerHalo`) or inputs
        ``halo`` holds."""
        self.halo = halo

    def use_stacked(self, stacked: StackedSteps | GRUSteps) -> None:
        """Runs this rank's steps as ``stacked`` (batched over the C-intervals, see
        :mod:`mpx.mgrit.adjoint.stacked` and :mod:`mpx.mgrit.adjoint.gru_steps`) in both
        solves instead of one ``phi`` call per step."""
        self.stacked = stacked
        for solver, step, into in (
            (self.fwd, self._step_rows, self._step_into),
            (self.bwd, self._adjoint_rows, self._adjoint_into),
        ):
            solver.step, solver.step_into = step, into
            solver.vectorized = solver.float_times = True

    def _rows(self, t: Any) -> tuple[int, int]:
        """Global index of the first row's point and the stride of the rows at times ``t``."""
        if isinstance(t, float):
            return self._index(t), 1
        first = self._index(float(t[0]))
        return first, (self._index(float(t[1])) - first if t.shape[0] > 1 else 1)

    def _step_rows(self, x: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self._step_into(x, t, dt, out)
        return out

    def _step_into(self, x: torch.Tensor, t: Any, dt: Any, out: torch.Tensor) -> None:
        if x.shape[0] == 0:
            return
        assert self.stacked is not None
        self.work["forward"] += x.shape[0]
        start = time.perf_counter()
        i, stride = self._rows(t)
        self.stacked.step_into(x, i - self.first, stride, dt, out)
        self._clock("forward", x.shape[0], start)

    def _clock(self, kind: str, rows: int, start: float) -> None:
        key = f"{kind}_single" if rows == 1 else kind
        self.seconds[key] = self.seconds.get(key, 0.0) + time.perf_counter() - start
        if rows == 1:
            self.seconds[f"{key}_calls"] = self.seconds.get(f"{key}_calls", 0.0) + 1

    def _adjoint_rows(self, lam: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
        out = torch.empty_like(lam, memory_format=torch.contiguous_format)
        self._adjoint_into(lam, t, dt, out)
        return out

    def _adjoint_into(self, lam: torch.Tensor, t: Any, dt: Any, out: torch.Tensor) -> None:
        if lam.shape[0] == 0:
            return
        assert self.stacked is not None
        # GRUSteps reads the forcing itself; LayerParallel's adjoint has none.
        assert self._forcing is None or isinstance(self.stacked, GRUSteps)
        self.work["adjoint"] += lam.shape[0]
        start = time.perf_counter()
        j, stride = self._rows(t)
        # Reversed point j steps with layer N-1-j: row j - (N - stop) of the reversed data.
        self.stacked.adjoint_into(lam, j - (self.N - self.stop), stride, dt, out)
        self._clock("adjoint", lam.shape[0], start)

    def owned_steps(self) -> range:
        """The steps this rank holds (their layers live here)."""
        return range(self.first, self.stop)

    def _index(self, t: float) -> int:
        return round(t / self.h)

    def _step(self, x: torch.Tensor, t: float, dt: float) -> torch.Tensor:
        self.work["forward"] += 1
        return self.phi(self._index(t), x, dt)

    def _adjoint_step(self, lam: torch.Tensor, t: float, dt: float) -> torch.Tensor:
        k = self.N - 1 - self._index(t)
        assert self._states is not None
        if k < self.first:  # the previous block's last step (fine split: see use_halo)
            assert self.halo is not None
            assert self.halo.state is not None
            x_k = self.halo.state
            source = None if self._forcing is None else self.halo.forcing
        else:
            x_k = self._states[k - self.first]
            source = None if self._forcing is None else self._forcing[k - self.first]
        if source is not None:
            # The loss reads x_{k+1} too: lam_{k+1} = nu_{k+1} + dL/dx_{k+1} (see adjoint()).
            lam = lam + source
        self.work["linearize"] += 1
        self.work["adjoint"] += 1
        with torch.enable_grad():
            x = x_k.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(self.phi(k, x, dt), x, lam, allow_unused=True)
        return torch.zeros_like(lam) if g is None else g

    # -- the two solves -------------------------------------------------------

    def forward(self, x0: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, Lease]:
        """Forward MGRIT solve, no autograd: ``x_N``, this rank's states (for the adjoint)
        and their lease: keep it as long as the states are read (see :class:`Lease`)."""
        self.check_open()
        self.work["forward"] = 0
        self.seconds = {}
        if self.halo is not None:  # first: the stacked weights include its layers
            self.halo.refresh()
        if self.stacked is not None:
            self.stacked.refresh()
        spare = self._returned()
        if spare is not None:
            self.fwd.reuse_fine(spare)
        with torch.no_grad():
            xN = self.fwd.solve(x0.detach())
        states = self.fwd.detach_fine()
        lease = Lease()
        self._leased = [(t, ref) for t, ref in self._leased if ref() is not None]
        self._leased.append((states, weakref.ref(lease)))
        return xN, states, lease

    def _share_state(self, states: torch.Tensor) -> None:
        """Before an adjoint solve about ``states``: the left neighbour's ``x_{a-1}`` in the
        halo. Shared here, not after the forward solve, because the halo belongs to the
        stepper, not to one pass: ParallelGRU runs every layer on one stepper, so the
        last forward's state is the last layer's when an earlier layer's adjoint runs."""
        if self.halo is not None:
            count = self.stop - self.first
            self.halo.share_state(states[count - 1] if count > 0 else None)

    def _returned(self) -> torch.Tensor | None:
        """A state tensor whose lease has ended (for the solver to write again), if any."""
        for i, (states, ref) in enumerate(self._leased):
            if ref() is None:
                del self._leased[i]
                return states
        return None

    def adjoint(self, states: torch.Tensor, forcing: torch.Tensor) -> torch.Tensor:
        """The adjoint of a loss of every state: ``lam_{k+1}`` for this rank's steps k, in order.

        ``forcing`` holds ``dL/dx_{k+1}`` of this rank's points (rows of ``states[1:]``,
        the final point's gradient included). The adjoint ``lam_k = J_k^T lam_{k+1} +
        dL/dx_k`` is solved for ``nu_k = lam_k - dL/dx_k``, which starts from 0 at
        ``x_N``, and whose step ``nu_k = J_k^T (nu_{k+1} + dL/dx_{k+1})`` reads the
        forcing at the step's start: a point this rank owns, except for the step before
        its block on the fine split (its last point is the left neighbour's: the halo
        brings it).
        """
        self.check_open()
        self._states, self._forcing = states, forcing
        self._reset_backward_work()
        self._share_state(states)
        before = None
        if self.halo is not None:
            n = self.stop - self.first
            self.halo.share_forcing(forcing[n - 1] if n > 0 else None)
            if self.halo.state is not None:
                assert self.halo.forcing is not None
                before = (self.halo.state, self.halo.forcing)
        batched = self.stacked if isinstance(self.stacked, GRUSteps) else None
        try:
            if batched is not None:
                batched.begin_adjoint(states, forcing, before)
            with torch.no_grad():
                self.bwd.solve(states.new_zeros(states.shape[1:]))
        finally:
            self._states, self._forcing = None, None
            if batched is not None:
                batched.release()
        return self._lam_next(forcing)

    def _reset_backward_work(self) -> None:
        for kind in WORK_KINDS[1:]:
            self.work[kind] = 0

    def _lam_next(self, forcing: torch.Tensor | None) -> torch.Tensor:
        """``lam_{k+1}`` (or ``nu_{k+1} + forcing``) of the owned steps k, after the solve."""
        rev_first = self.bwd.layout.levels[0].first
        rows = [self.N - 1 - k - rev_first for k in self.owned_steps()]
        lams = self.bwd._u[0][rows]
        return lams if forcing is None else lams + forcing

    def backward(
        self, gN: torch.Tensor, tensors: Sequence[torch.Tensor], states: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Adjoint MGRIT solve from ``gN`` about the forward ``states``.

        Returns:
            dL/dx0 (on every rank) and the gradients of ``tensors``.
        """
        self.check_open()
        self._states = states
        self._reset_backward_work()
        self._share_state(states)
        try:
            if isinstance(self.stacked, StackedSteps):
                return self._stacked_backward(gN, tensors, self.stacked)
            return self._backward(gN, tensors)
        finally:
            self._states = None

    def _stacked_backward(
        self, gN: torch.Tensor, tensors: Sequence[torch.Tensor], stacked: StackedSteps
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """The adjoint and the gradients with one linearisation of every local step."""
        assert self._states is not None
        n = self.stop - self.first
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        lam0 = torch.zeros_like(gN)
        try:
            with torch.no_grad():
                if n > 0:
                    start = time.perf_counter()
                    stacked.linearize(self._states, None if self.halo is None else self.halo.state)
                    self.seconds["linearize"] = time.perf_counter() - start
                    self.work["linearize"] += n
                self.bwd.solve(gN.detach())
                if n > 0:
                    assert self.bwd.layout.levels[0].first == self.N - self.stop
                    start = time.perf_counter()
                    per_step, first = stacked.gradients(self.bwd._u[0], self.h)
                    self.seconds["gradient"] = time.perf_counter() - start
                    self.work["gradient"] += n
                    for k, got in zip(self.owned_steps(), per_step, strict=True):
                        for i, g in zip(self.uses(k), got, strict=True):
                            grads[i] = g
                    if self.first == 0:
                        lam0 = first
        finally:
            stacked.release()
        return self._share_lam0(lam0, gN), grads

    def _share_lam0(self, lam0: torch.Tensor, gN: torch.Tensor) -> torch.Tensor:
        """dL/dx0 from forward rank 0 on every rank (the opening layer is replicated)."""
        if self.comm.size == 1:
            return lam0
        buf = lam0.detach().to("cpu", copy=True).contiguous()
        broadcast(buf, 0, comm=self.comm)
        return buf.to(gN.device)

    def _backward(
        self, gN: torch.Tensor, tensors: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        with torch.no_grad():
            self.bwd.solve(gN.detach())
        lams = self.bwd._u[0]  # reversed points rev_first .. rev_first + count
        rev_first = self.bwd.layout.levels[0].first
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        lam0 = torch.zeros_like(gN)
        assert self._states is not None
        for k in self.owned_steps():
            # Final fine sweep: lam_{k+1} (reversed point N-1-k) drives step k's gradients.
            lam_next = lams[self.N - 1 - k - rev_first]
            idx = list(self.uses(k))
            self.work["linearize"] += 1
            self.work["gradient"] += 1
            with torch.enable_grad():
                x = self._states[k - self.first].detach().requires_grad_(True)
                out = self.phi(k, x, self.h)
                got = torch.autograd.grad(
                    out, [x, *(tensors[i] for i in idx)], lam_next, allow_unused=True
                )
            for i, g in zip(idx, got[1:], strict=True):
                if g is not None:
                    grads[i] = g if grads[i] is None else grads[i] + g  # type: ignore[operator]
            if k == 0 and got[0] is not None:
                lam0 = got[0]
        return self._share_lam0(lam0, gN), grads

    def apply(self, x0: torch.Tensor, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """``x_N`` as a differentiable function of ``x0`` and ``tensors``."""
        out: torch.Tensor = _Solve.apply(self, x0, *tensors)  # type: ignore[no-untyped-call]
        return out


class _Solve(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, stepper: TimeStepper, x0: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.stepper = stepper
        ctx.tensors = tensors
        xN, ctx.states, ctx.lease = stepper.forward(x0)
        return xN

    @staticmethod
    def backward(ctx: Any, gN: torch.Tensor) -> Any:
        stepper: TimeStepper = ctx.stepper
        lam0, grads = stepper.backward(gN, ctx.tensors, ctx.states)
        return (None, lam0, *grads)
