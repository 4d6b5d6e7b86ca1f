"""ParallelGRU's steps batched over the C-intervals, and its adjoint without a replayed forward.

Every step of a GRU layer uses the same weights, so the j-th steps of all the
C-intervals of a rank are one cell over the stacked rows: one matrix product
``h W_hh^T`` for all of them, the input projections ``x W_ih^T + b_ih`` of every
position computed once per layer as one matrix product (as torch.nn.GRU does)::

    rows h_i (n, B, H) at steps k_i   gates gi[k_i] (precomputed)   ->   h'_i (n, B, H)

The steps are :mod:`mpx.mgrit.gru`'s: the cell for a step of size 1, the implicit
coarse step ``(h + a n) / (1 + a)``, ``a = m (1 - z)``, for size m, the identity
over padding, and a coarse step reaching into the padding of size its real part
(with the gates of its own position: a zero input's where that is padding).

On the fine split a rank also steps from its last point (step ``stop``, the
next block's first, in the forward solve) and, in the adjoint, the step before
its block (``first - 1``, from the left neighbour's last point): the gates are
kept for local steps ``-1 .. n`` (row ``k + 1`` for local step k), and the
adjoint's linearisation of step -1 reads the state and source the halo
(:class:`mpx.mgrit.adjoint.halo.StateHalo`) brought.

The adjoint step at reversed point j is the vector-Jacobian product of step
``k = N-1-j`` of the level's size at the stored forward state ``h_k``. Its
Jacobian has one form for both kinds of step::

    J^T lam = A * lam + (C * [lam, lam, lam]) W_hh      A (B, H), C (B, 3H) per step

(cell: ``A = z``; coarse: ``A = 1 / (1 + a)``; identity: ``A = 1, C = 0``), so the
backward linearises each step it needs once per step size (one batched forward
of the gates) and every adjoint step after that is one matrix product, with no
forward replayed through autograd.
"""

from __future__ import annotations

import torch

__all__ = ["GRUSteps"]

#: ``(weight_ih, weight_hh, bias_ih, bias_hh)`` of one layer direction.
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _size(dt: torch.Tensor | float) -> int:
    """The step size (a whole number of fine steps) of a call's rows."""
    return round(dt if isinstance(dt, float) else float(dt[0]))


class GRUSteps:
    """The steps of one direction's grid on this rank, run batched (see the module doc).

    Args:
        first, stop: this rank's steps ``[first, stop)``.
        lo, hi: the real steps (the rest is identity padding).
        work: the stepper's work counts (``"linearize"`` is added to here).

    Example::

        steps = GRUSteps(stepper.first, stepper.stop, lo, hi, stepper.work)
        stepper.use_stacked(steps)
        gi = steps.local_gates(weights, rows, real)   # rows: the inputs of steps `real`
        steps.prepare(weights, gi)        # before a forward solve or an adjoint
    """

    def __init__(self, first: int, stop: int, lo: int, hi: int, work: dict[str, int]) -> None:
        self.first, self.stop = first, stop
        self.n = stop - first
        # The real steps in this rank's local numbering (step k is local k - first).
        self.lo, self.hi = lo - first, hi - first
        self.work = work
        self._w_hh = torch.empty(0)
        self._b_hh: torch.Tensor | None = None
        self._gi = torch.empty(0)  # row k + 1: local step k, for k in -1 .. n
        self._states = torch.empty(0)
        self._forcing: torch.Tensor | None = None
        # The state and source of the step before the block (local -1), on the fine split.
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None
        # Per (step size, first reversed row): (A, C, forcing) of the steps the adjoint
        # reads at that size (the rows of one level: one phase per size).
        self._lin: dict[
            tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]
        ] = {}

    # -- the forward ----------------------------------------------------------

    @staticmethod
    def input_gates(weights: Weights, x: torch.Tensor) -> torch.Tensor:
        """``x W_ih^T + b_ih`` of the rows of ``x``, one matrix product."""
        w_ih, b_ih = weights[0], weights[2]
        flat = x.reshape(-1, x.shape[-1])
        out = torch.mm(flat, w_ih.t()) if b_ih is None else torch.addmm(b_ih, flat, w_ih.t())
        return out.view(*x.shape[:-1], w_ih.shape[0])

    def local_gates(self, weights: Weights, rows: torch.Tensor, real: range) -> torch.Tensor:
        """The input gates of local steps ``-1 .. n`` (row ``k + 1``), from ``rows``: the
        inputs of the ``real`` steps (global, in ``[first - 1, stop]``) in step order;
        every other step's are a zero input's (``b_ih``: padding, or unread)."""
        gi = rows.new_zeros((self.n + 2, *rows.shape[1:-1], weights[0].shape[0]))
        if weights[2] is not None:
            gi += weights[2]
        if len(real) > 0:
            at = real.start - self.first + 1
            gi[at : at + len(real)] = self.input_gates(weights, rows)
        return gi

    def prepare(self, weights: Weights, gi: torch.Tensor) -> None:
        """The weights and the local input gates of the next solve."""
        self._w_hh, self._b_hh, self._gi = weights[1].detach(), weights[3], gi
        if self._b_hh is not None:
            self._b_hh = self._b_hh.detach()

    def refresh(self) -> bool:
        """Nothing to stack: the cell's weights are shared by every step."""
        return False

    def _rows(
        self, k0: int, stride: int, n: int, size: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The input gates of local steps ``k0, k0 + stride, ...`` and, unless every one
        is a whole real step of ``size``, the real part of each (0: identity)."""
        last = k0 + (n - 1) * stride
        if k0 >= self.lo and last + size <= self.hi:
            return self._gi[k0 + 1 : last + 2 : stride], None
        ks = torch.arange(k0, last + 1, stride)
        return self._gathered(ks, size)

    def _gathered(self, ks: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # A step over [k, k + size) steps over its real part with the gates of its own
        # position (gru.py's Direction.phi): a zero input's where k is padding.
        real = ((ks + size).clamp(max=self.hi) - ks.clamp(min=self.lo)).clamp(min=0)
        gates = self._gi.index_select(0, (ks + 1).to(self._gi.device))
        return gates, real

    def _gates(
        self, h2: torch.Tensor, gi2: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h_n, r, z, n`` of the cell at states ``h2`` (rows, H) and input gates ``gi2``,
        in torch.gru_cell's order of operations."""
        gh = torch.mm(h2, self._w_hh.t()) if self._b_hh is None else torch.addmm(
            self._b_hh, h2, self._w_hh.t()
        )  # fmt: skip
        h_r, h_z, h_n = gh.chunk(3, 1)
        i_r, i_z, i_n = gi2.chunk(3, 1)
        r = (h_r + i_r).sigmoid_()
        z = (h_z + i_z).sigmoid_()
        new = (h_n * r).add_(i_n).tanh_()
        return h_n, r, z, new

    def step_into(
        self, h: torch.Tensor, k0: int, stride: int, dt: torch.Tensor | float, out: torch.Tensor
    ) -> None:
        """Local steps ``k0, k0 + stride, ...`` of size ``dt`` from the rows ``h``, into ``out``."""
        n, size, hidden = h.shape[0], _size(dt), h.shape[-1]
        gi, real = self._rows(k0, stride, n, size)
        h2 = h.reshape(-1, hidden)  # the rows of a level are strided: one copy for the product
        _, _, z, new = self._gates(h2, gi.reshape(h2.shape[0], -1))
        # The results go straight into the level's (strided) rows.
        h3, z3, new3, o3 = (t.view(n, -1, hidden) for t in (h2, z, new, out))
        if size == 1 and real is None:
            torch.sub(h3, new3, out=o3)
            o3.mul_(z3).add_(new3)  # (h - n) z + n: the cell
            return
        e = (torch.full((n,), size) if real is None else real).to(h).view(n, 1, 1)
        a = (1 - z3).mul_(e)
        torch.div(h3 + a * new3, 1 + a, out=o3)  # the identity exactly where e = 0
        if real is not None and bool((real == 1).any()):
            cell = (h3 - new3).mul_(z3).add_(new3)
            torch.where(e == 1, cell, o3, out=o3)

    # -- the adjoint ----------------------------------------------------------

    def begin_adjoint(
        self,
        states: torch.Tensor,
        forcing: torch.Tensor | None,
        before: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The forward states (rows ``0..n-1``: the states the local steps start from), the
        adjoint's source at each step's end (see TimeStepper.adjoint) and, on the fine
        split, the state and source of the step before the block (None: no such step)."""
        self._states, self._forcing, self._before, self._lin = states, forcing, before, {}

    def release(self) -> None:
        """Drops the linearisations and the solve's data."""
        self._states, self._forcing, self._before, self._lin = torch.empty(0), None, None, {}

    def _linearize(
        self, size: int, phase: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A and C (module doc) of the steps of ``size`` the adjoint reads: reversed rows
        ``phase, phase + size, ...``, i.e. local steps ``n-1-phase, n-1-phase-size, ...``,
        down to -1 (the step before the block) where the halo brought its state."""
        got = self._lin.get((size, phase))
        if got is not None:
            return got
        ks = torch.arange(self.n - 1 - phase, -1 if self._before is None else -2, -size)
        m, hidden = ks.shape[0], self._states.shape[-1]
        gates, real = self._gathered(ks, size)
        inner = ks[ks >= 0]  # descending: only the last one may be -1
        idx = inner.to(self._states.device)
        h = self._states.index_select(0, idx)
        forcing = None if self._forcing is None else self._forcing.index_select(0, idx)
        if inner.shape[0] < m:
            assert self._before is not None
            h = torch.cat([h, self._before[0].unsqueeze(0)])
            if forcing is not None:
                forcing = torch.cat([forcing, self._before[1].unsqueeze(0)])
        h2 = h.reshape(-1, hidden)
        h_n, r, z, new = self._gates(h2, gates.reshape(h2.shape[0], -1))
        e = real.to(h).repeat_interleave(h2.shape[0] // m).unsqueeze(1)
        dtanh = 1 - new * new
        # Coarse step (h + a n) / (1 + a), a = e (1 - z); e = 0 is the identity (A = 1, C = 0).
        a = (1 - z) * e
        d = 1 + a
        after = (h2 + a * new) / d
        A = 1 / d
        dn = (a / d) * dtanh  # d h' / d(pre-activation of n)
        dz = -e * (new - after) / d * z * (1 - z)  # d h' / d(pre-activation of z)
        cell = e == 1
        if bool(cell.any()):
            # The cell h' = (h - n) z + n: A = z, dn = (1 - z) tanh', dz = (h - n) z (1 - z).
            A = torch.where(cell, z, A)
            dn = torch.where(cell, (1 - z) * dtanh, dn)
            dz = torch.where(cell, (h2 - new) * z * (1 - z), dz)
        C = torch.cat([dn * h_n * r * (1 - r), dz, dn * r], dim=1)
        self.work["linearize"] += m
        shape = h.shape
        got = (A.view(shape), C.view(*shape[:-1], 3 * hidden), forcing)
        self._lin[(size, phase)] = got
        return got

    def adjoint_into(
        self, lam: torch.Tensor, r0: int, stride: int, dt: torch.Tensor | float, out: torch.Tensor
    ) -> None:
        """``J_k^T (lam + forcing_k)`` for reversed rows ``r0, r0 + stride, ...`` (step
        ``k = n-1-r`` of size ``dt``), into ``out``."""
        n, size, hidden = lam.shape[0], _size(dt), lam.shape[-1]
        phase = r0 % size  # where this rank's block starts among the level's points
        A, C, forcing = self._linearize(size, phase)
        assert n == 1 or stride % size == 0, (stride, size)  # the rows of one level
        c0, cs = (r0 - phase) // size, max(stride // size, 1)
        rs = slice(c0, c0 + (n - 1) * cs + 1, cs)
        lamf = lam if forcing is None else lam + forcing[rs]
        weighted = C[rs].view(n, -1, 3, hidden) * lamf.reshape(n, -1, 1, hidden)
        back = torch.mm(weighted.view(-1, 3 * hidden), self._w_hh).view(n, -1, hidden)
        # (C lam) W_hh + A lam, written into the level's (strided) rows.
        torch.addcmul(
            back, lamf.view(n, -1, hidden), A[rs].view(n, -1, hidden), out=out.view(n, -1, hidden)
        )
