"""One direction of one ParallelGRU layer across the ranks: its steps, its grid, its autograd.

:mod:`mpx.mgrit.gru` holds the module users build (:class:`~mpx.mgrit.ParallelGRU`);
this module holds what runs one direction of one layer under it: the step
(:func:`gru_step`: the GRU cell at step size 1, the implicit coarse step
otherwise), the grid of a sequence length (:class:`Direction`: the solver and
the position each step reads) and the autograd functions (:class:`Layer`: the
states and the adjoint; :class:`Gather`: every rank's block of states).
See :mod:`mpx.mgrit.gru` for the method.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, allgather, allreduce, broadcast
from mpx.mgrit.adjoint import GRUSteps, StateHalo, TimeStepper
from mpx.mgrit.solver import Layout, MGRITOptions

__all__ = ["Direction", "Gather", "Layer", "Weights", "gru_step"]

#: ``(weight_ih, weight_hh, bias_ih, bias_hh)`` of one layer, as :class:`torch.nn.GRU` names them.
Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def _weights(cell: nn.GRUCell | Weights) -> Weights:
    if isinstance(cell, nn.GRUCell):
        return cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh
    return cell


def _gates(w: Weights, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The update gate z and the candidate n of the cell at input x and state h."""
    gi = nn.functional.linear(x, w[0], w[2])
    gh = nn.functional.linear(h, w[1], w[3])
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return z, n


def gru_step(
    cell: nn.GRUCell | Weights, x: torch.Tensor, h: torch.Tensor, dt: float
) -> torch.Tensor:
    """One step of size ``dt``: the GRU cell for dt = 1, the implicit coarse step otherwise."""
    w = _weights(cell)
    if dt == 1.0:
        return torch.gru_cell(x, h, w[0], w[1], w[2], w[3])
    z, n = _gates(w, x, h)
    a = dt * (1 - z)
    return (h + a * n) / (1 + a)


def _owner(layout: Layout, step: int) -> int:
    """The rank (of the layout's communicator) whose block holds fine step ``step``."""
    for rank in range(layout.size):
        if layout.starts[rank] <= step < layout.starts[rank + 1]:
            return rank
    raise AssertionError(f"step {step} is outside the grid of {layout.nt} steps")


class Direction:
    """One direction of a sequence length's grid: its solver and the position each step reads.

    Step ``k`` of the forward direction reads position ``k``; step ``j`` of the
    reverse one reads position ``P - 1 - j``. Steps that read no position (the
    padding: steps outside ``[lo, hi)``) are the identity; a coarse step from
    padding into real steps reads a zero input (its position holds none).

    The fine grid is split over the ranks (:mod:`mpx.mgrit.solver.grid`): besides its own
    steps ``[first, stop)`` a rank steps from its last point (step ``stop``) and,
    in the adjoint, the step ``first - 1`` before its block. Their input rows come
    with the inputs (see :class:`Layer`); the forward state and the adjoint's
    source at ``first - 1`` come through :attr:`halo`.
    """

    def __init__(
        self,
        reverse: bool,
        length: int,
        padded: int,
        comm: Communicator,
        blocks: tuple[Sequence[int], Sequence[int]] | None,
        options: MGRITOptions,
        batched: bool = True,
    ) -> None:
        self.reverse, self.length, self.padded = reverse, length, padded
        self.lo, self.hi = (padded - length, padded) if reverse else (0, length)
        # What the steps read while a solve runs: the layer's weights, its inputs and
        # the position of the inputs' first row; set around every solve.
        self.current: tuple[Weights, torch.Tensor, int] | None = None
        self.stepper = TimeStepper(
            self.phi, lambda k: [], padded, float(padded), comm=comm, blocks=blocks,
            options=options, fine_split=True,
        )  # fmt: skip
        st = self.stepper
        fine = st.fwd.layout.levels[0]
        #: the neighbours' rows (None: this rank's block has no neighbour)
        self.halo: StateHalo | None = None
        if fine.left is not None or fine.right is not None:
            self.halo = StateHalo(st.comm, fine.left, fine.right)
            st.use_halo(self.halo)
        #: the batched steps (see mpx.mgrit.adjoint.gru_steps), or None: one phi call per step
        self.steps = GRUSteps(st.first, st.stop, self.lo, self.hi, st.work) if batched else None
        if self.steps is not None:
            st.use_stacked(self.steps)

    def prepare(self, weights: Weights, inputs: torch.Tensor, offset: int) -> torch.Tensor | None:
        """The batched steps' input gates of this rank's steps and its boundary steps
        (None unbatched)."""
        if self.steps is None:
            return None
        real = self.stepped_steps(inputs, offset)
        a, b = self.rows(real, offset)
        rows = inputs[a:b].flip(0) if self.reverse else inputs[a:b]
        detached = tuple(None if w is None else w.detach() for w in weights)
        gi = self.steps.local_gates(detached, rows, real)  # type: ignore[arg-type]
        self.steps.prepare(detached, gi)  # type: ignore[arg-type]
        return gi

    def position(self, step: int) -> int:
        return self.padded - 1 - step if self.reverse else step

    def phi(self, k: int, h: torch.Tensor, dt: float) -> torch.Tensor:
        # A coarse step over [k, k + dt) steps only over its real part (the padding adds
        # nothing), with the gates of its own position: a zero input's where that is
        # padding, so that no step needs an input row of a block beyond its neighbours'.
        a, b = max(k, self.lo), min(k + round(dt), self.hi)
        if b <= a:
            return h.clone()
        assert self.current is not None
        weights, inputs, offset = self.current
        real = k >= self.lo
        x = inputs[self.position(k) - offset] if real else inputs.new_zeros(inputs.shape[1:])
        return gru_step(weights, x, h, float(b - a))

    def real_steps(self) -> range:
        """This rank's steps that read a position, in step order."""
        own = self.stepper.owned_steps()
        start = max(own.start, self.lo)
        return range(start, max(start, min(own.stop, self.hi)))

    def stepped_steps(self, inputs: torch.Tensor, offset: int) -> range:
        """The steps this rank may step that read a position in ``inputs`` (first row at
        position ``offset``): its own and its boundary steps ``first - 1`` and ``stop``."""
        st = self.stepper
        if st.stop == st.first:
            return range(st.first, st.first)
        if self.reverse:  # position P - 1 - k in [offset, offset + len)
            have = range(self.padded - offset - inputs.shape[0], self.padded - offset)
        else:
            have = range(offset, offset + inputs.shape[0])
        start = max(st.first - 1, self.lo, have.start)
        return range(start, max(start, min(st.stop + 1, self.hi, have.stop)))

    def rows(self, steps: range, offset: int) -> tuple[int, int]:
        """The rows ``[a, b)`` of inputs (first row at position ``offset``) that ``steps`` read.

        Forward in step order; reverse in reversed step order (flip them).
        """
        if self.reverse:
            return self.padded - steps.stop - offset, self.padded - steps.start - offset
        return steps.start - offset, steps.stop - offset


def _sum_over_ranks(tensors: list[torch.Tensor], comm: Communicator) -> list[torch.Tensor]:
    """Every tensor summed over the ranks, in one allreduce of their concatenation."""
    if comm.size == 1 or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).to("cpu", copy=True)
    total = allreduce(flat, "sum", comm=comm).to(tensors[0].device)
    parts = torch.split(total, [t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors, strict=True)]


def _from_owner(row: torch.Tensor | None, like: torch.Tensor, root: int, comm: Communicator) -> Any:
    """``row`` of rank ``root`` on every rank (``like`` gives the shape elsewhere)."""
    if comm.size == 1:
        assert row is not None
        return row.clone()
    src = row if comm.rank == root and row is not None else torch.zeros_like(like)
    buf = src.detach().to("cpu", copy=True).contiguous()
    broadcast(buf, root, comm=comm)
    return buf.to(like.device)


class Layer(torch.autograd.Function):
    """One direction of one GRU layer: this rank's states and the final state, with the adjoint.

    ``inputs`` is the whole sequence (layer 0, replicated on every rank: ``offset``
    None) or this rank's block of the previous layer's output (``offset`` = the
    position of its first row). Which one is said, not guessed from shapes: a rank
    whose block is the whole sequence must still sum the input gradient with the others.
    """

    @staticmethod
    def forward(
        ctx: Any,
        direction: Direction,
        weights: Weights,
        inputs: torch.Tensor,
        offset: int | None,
        h0: torch.Tensor,
        *params: torch.Tensor,
    ) -> Any:
        ctx.replicated = offset is None
        offset = 0 if offset is None else offset
        stepper = direction.stepper
        direction.current = (weights, inputs.detach(), offset)
        ctx.gates = direction.prepare(weights, inputs.detach(), offset)
        try:
            x_end, states, ctx.lease = stepper.forward(h0)
        finally:
            direction.current = None
        # The final state is after the last real step: the end of the grid, or (forward
        # direction, padded) point T, broadcast by the rank that holds it.
        final = direction.hi
        if final == stepper.N:
            h_last = x_end
        else:
            root = _owner(stepper.fwd.layout, final - 1)
            mine = states[final - stepper.first] if stepper.comm.rank == root else None
            h_last = _from_owner(mine, h0, root, stepper.comm)
        ctx.direction, ctx.weights, ctx.offset = direction, weights, offset
        ctx.save_for_backward(inputs.detach(), states)
        return states[1:].clone(), h_last

    @staticmethod
    def backward(ctx: Any, g_block: torch.Tensor | None, g_last: torch.Tensor | None) -> Any:
        direction: Direction = ctx.direction
        stepper = direction.stepper
        comm = stepper.comm
        inputs, states = ctx.saved_tensors
        forcing = torch.zeros_like(states[1:]) if g_block is None else g_block.clone()
        final = direction.hi
        if g_last is not None and comm.rank == _owner(stepper.fwd.layout, final - 1):
            forcing[final - 1 - stepper.first] += g_last  # this rank holds the final state
        direction.current = (ctx.weights, inputs, ctx.offset)
        if direction.steps is not None:
            direction.steps.prepare(ctx.weights, ctx.gates)
        try:
            lam_next = stepper.adjoint(states, forcing)
        finally:
            direction.current = None
        # The final fine sweep over this rank's real steps, in one batched cell call;
        # padding steps are the identity and touch no weight.
        steps = direction.real_steps()
        rows = slice(steps.start - stepper.first, steps.stop - stepper.first)
        a, b = direction.rows(steps, ctx.offset)
        params = [w for w in ctx.weights if w is not None]
        with torch.enable_grad():
            h = states[rows].detach().requires_grad_(True)
            x = inputs[a:b].flip(0) if direction.reverse else inputs[a:b]
            x = x.detach().requires_grad_(True)
            n, batch = h.shape[0], h.shape[1:-1].numel()
            weights = tuple(w.detach().requires_grad_(True) if w is not None else None
                            for w in ctx.weights)  # fmt: skip
            flat_x, flat_h = x.reshape(n * batch, x.shape[-1]), h.reshape(n * batch, h.shape[-1])
            out = gru_step(weights, flat_x, flat_h, 1.0)  # type: ignore[arg-type]
            leaves = [h, x, *(w for w in weights if w is not None)]
            got = torch.autograd.grad(
                out, leaves, lam_next[rows].reshape_as(out), allow_unused=True
            )
        g_params = [
            torch.zeros_like(p) if g is None else g for g, p in zip(got[2:], params, strict=True)
        ]
        # dL/dh0 is the gradient at the first real step's state (padding before it in the
        # reverse direction is the identity), held by that step's rank.
        root = _owner(stepper.fwd.layout, direction.lo)
        mine = got[0][0] if steps.start == direction.lo and n > 0 and got[0] is not None else None
        g_h0 = _from_owner(mine, states[0], root, comm)
        g_inputs = None
        if ctx.needs_input_grad[2]:
            part = torch.zeros_like(x) if got[1] is None else got[1].view_as(x)
            g_inputs = torch.zeros_like(inputs)
            g_inputs[a:b] = part.flip(0) if direction.reverse else part
            if ctx.replicated:
                # The whole sequence on every rank: each rank's rows, summed over ranks.
                g_inputs = _sum_over_ranks([g_inputs], comm)[0]
        g_params = _sum_over_ranks(g_params, comm)
        return (None, None, g_inputs, None, g_h0, *g_params)


class Gather(torch.autograd.Function):
    """Every rank's block of states, in time order, on every rank; backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, stepper: TimeStepper, block: torch.Tensor) -> Any:
        ctx.steps = stepper.owned_steps()
        comm = stepper.comm
        if comm.size == 1:
            return block.clone()
        counts = stepper.fwd.layout.blocks  # fine steps per rank
        padded = block.new_zeros((max(counts), *block.shape[1:]), device="cpu")
        padded[: block.shape[0]] = block
        every = allgather(padded, comm=comm)
        return torch.cat([every[r, :c] for r, c in enumerate(counts)]).to(block.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Every rank computes the same loss of the whole output: its block's share is its slice.
        return None, grad[ctx.steps.start : ctx.steps.stop].clone()
