"""A GRU over a long sequence, parallel in time: a drop-in for :class:`torch.nn.GRU`.

The recurrence ``h_{k+1} = GRUCell(x_k, h_k)`` is a time-stepping problem with
step size 1, so MGRIT solves it across ranks (Moon & Cyr 2022). Written as

    h_{k+1} = h_k + (1 - z_k) (n_k - h_k)           (the GRU cell exactly)

its coarse levels take a step of size ``m`` implicitly in the decay term, which
stays stable for any ``m``:

    h_{k+m} = (h_k + m (1 - z_k) n_k) / (1 + m (1 - z_k))

with the gates ``z_k, n_k`` of the input at the coarse step's start. The fine
level is the GRU cell itself, so a converged solve is the serial loop.

Layers are solved one after the other, each over the whole sequence; the
states of layer l on a rank's block of time are the inputs of layer l+1 on
the same block, so only the last layer's states are gathered (the output)::

    x:        [x_0 ... x_a) [x_a ... x_b) [x_b ... x_T)  (the whole sequence on every rank)
    layer 0:   rank 0         rank 1        rank 2       -> states stay on their rank
    layer 1:   rank 0         rank 1        rank 2       -> output gathered, h_n broadcast

**Any length.** The grid needs whole coarsest intervals (every coarse point is a
fine point), so a sequence of T steps is padded to P, the next multiple of the
coarsest interval, with *identity* steps at positions T..P-1. An identity step is
exact on every level (a coarse step over padding only is the identity too, and
one that reaches into the padding steps only over its real part), so the
converged solve is still the serial loop and the padding costs P - T cheap steps
instead of a ragged last window, which would need a non-uniform coarse grid and
a second kind of coarse step.

**Bidirectional.** The reverse direction reads position ``P - 1 - j`` at its step
``j``, on a solver whose ranks run in reverse order (the adjoint's
communicator): its block of positions on each rank is the forward direction's,
so the next layer's input (both directions concatenated) never crosses ranks.
Its padding comes first in its own time, so its final state is ``h`` after x_0.

**Dropout** between layers (training only) multiplies each layer's output but
the last by a mask drawn for the whole ``(T, batch, features)`` output on every
rank from torch's default generator, as ``torch.nn.GRU`` draws it: under the
same seed on every rank the masks are nn.GRU's, and each rank applies its block's
rows.

The weights are replicated (broadcast from rank 0 at construction); their
gradients, and the input's, are summed over ranks, so every rank ends with the
same gradients. The adjoint of a loss of every output step is an MGRIT solve
with a source term (:meth:`mpx.mgrit.adjoint.TimeStepper.adjoint`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, allgather, allreduce, broadcast
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.adjoint import TimeStepper, _levels_arg
from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.grid import Layout, coarsening_factors
from mpx.mgrit.gru_steps import GRUSteps

__all__ = ["ParallelGRU", "gru_step"]

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


def _int_arg(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MGRITConfigError(f"{name} must be an int >= 1, got {name}={value!r}")
    return value


def _owner(layout: Layout, step: int) -> int:
    """The rank (of the layout's communicator) whose block holds fine step ``step``."""
    span = layout.nt // sum(layout.blocks)
    start = 0
    for rank, blocks in enumerate(layout.blocks):
        if start <= step < start + blocks * span:
            return rank
        start += blocks * span
    raise AssertionError(f"step {step} is outside the grid of {layout.nt} steps")


class _Direction:
    """One direction of a sequence length's grid: its solver and the position each step reads.

    Step ``k`` of the forward direction reads position ``k``; step ``j`` of the
    reverse one reads position ``P - 1 - j``. Steps that read no position (the
    padding: steps outside ``[lo, hi)``) are the identity.
    """

    def __init__(
        self,
        reverse: bool,
        length: int,
        padded: int,
        comm: Communicator,
        blocks: tuple[Sequence[int], Sequence[int]] | None,
        config: dict[str, Any],
        batched: bool = True,
    ) -> None:
        self.reverse, self.length, self.padded = reverse, length, padded
        self.lo, self.hi = (padded - length, padded) if reverse else (0, length)
        # What the steps read while a solve runs: the layer's weights, its inputs and
        # the position of the inputs' first row; set around every solve.
        self.current: tuple[Weights, torch.Tensor, int] | None = None
        self.stepper = TimeStepper(
            self.phi, lambda k: [], padded, float(padded), comm=comm, skip_downcycle=True,
            blocks=blocks, **config,
        )  # fmt: skip
        st = self.stepper
        #: the batched steps (see mpx.mgrit.gru_steps), or None: one phi call per step
        self.steps = GRUSteps(st.first, st.stop, self.lo, self.hi, st.work) if batched else None
        if self.steps is not None:
            st.use_stacked(self.steps)

    def prepare(self, weights: Weights, inputs: torch.Tensor, offset: int) -> torch.Tensor | None:
        """The batched steps' input gates of this rank's steps (None unbatched)."""
        if self.steps is None:
            return None
        real = self.real_steps()
        a, b = self.rows(real, offset)
        rows = inputs[a:b].flip(0) if self.reverse else inputs[a:b]
        detached = tuple(None if w is None else w.detach() for w in weights)
        gi = self.steps.local_gates(detached, rows, real)  # type: ignore[arg-type]
        self.steps.prepare(detached, gi)  # type: ignore[arg-type]
        return gi

    def position(self, step: int) -> int:
        return self.padded - 1 - step if self.reverse else step

    def phi(self, k: int, h: torch.Tensor, dt: float) -> torch.Tensor:
        # A coarse step over [k, k + dt) steps only over its real part, with the gates
        # of its first real position (the padding adds nothing).
        a, b = max(k, self.lo), min(k + round(dt), self.hi)
        if b <= a:
            return h.clone()
        assert self.current is not None
        weights, inputs, offset = self.current
        return gru_step(weights, inputs[self.position(a) - offset], h, float(b - a))

    def real_steps(self) -> range:
        """This rank's steps that read a position, in step order."""
        own = self.stepper.owned_steps()
        start = max(own.start, self.lo)
        return range(start, max(start, min(own.stop, self.hi)))

    def rows(self, steps: range, offset: int) -> tuple[int, int]:
        """The rows ``[a, b)`` of inputs (first row at position ``offset``) that ``steps`` read.

        Forward in step order; reverse in reversed step order (flip them).
        """
        if self.reverse:
            return self.padded - steps.stop - offset, self.padded - steps.start - offset
        return steps.start - offset, steps.stop - offset


class ParallelGRU(nn.Module):
    """:class:`torch.nn.GRU` with the time steps of the sequence split over ranks.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first, dropout, bidirectional:
            as for :class:`torch.nn.GRU`; the parameters have its names
            (``weight_ih_l0``, ``..._reverse``), so state dicts load both ways, and
            under the same seed the weights are the ones ``torch.nn.GRU`` draws.
            ``dropout`` acts on the outputs of every layer but the last, in training
            mode only; under the same seed on every rank its masks are nn.GRU's.
        seq_len: if given, every input must have this length (else any length;
            lengths that are no multiple of the coarsest interval are padded with
            identity steps, see the module doc).
        comm: the ranks that share the sequence (default: all); an mpx Communicator or an
            mpi4py one (``MPI.COMM_WORLD``, as torchbraid takes it).
        levels, cfactor, fwd_iters, bwd_iters, tol, relax, nrelax: MGRIT settings,
            as for :class:`~mpx.mgrit.LayerParallel` (as are fwd_levels, bwd_levels,
            fwd_tol, bwd_tol, fine_relax and cycle_type).
        batched: run the j-th steps of all C-intervals of a rank as one cell over the
            stacked rows, the input projections precomputed, and each adjoint step as
            one vector-Jacobian product of a linearisation (see
            :mod:`mpx.mgrit.gru_steps`); False: one cell call per step, the adjoint
            replaying each step's forward through autograd.

    ``forward(input, hx=None)`` takes the whole sequence on every rank, ``(T, B, in)``
    (``(B, T, in)`` with ``batch_first``, or ``(T, in)`` unbatched) and ``hx`` of shape
    ``(D * num_layers, B, hidden)`` (D = 2 if bidirectional else 1), and returns
    ``(output, h_n)`` on every rank: the last layer's state at every step
    (``D * hidden`` features, the reverse direction's second) and every layer's and
    direction's final state, as ``torch.nn.GRU`` does. Converged (``levels=1``, or
    enough iterations) it is ``torch.nn.GRU`` to rounding.

    Example::

        gru = ParallelGRU(3, 8, num_layers=2, batch_first=True, bidirectional=True,
                          levels=2, cfactor=4, fwd_iters=3, bwd_iters=3)
        output, h_n = gru(torch.randn(5, 63, 3))      # (5, 63, 16), (4, 5, 8)
        output.sum().backward()
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        num_layers: int = 1,
        bias: bool = True,
        batch_first: bool = False,
        dropout: float = 0.0,
        bidirectional: bool = False,
        *,
        seq_len: int | None = None,
        comm: CommLike = None,
        levels: int = 2,
        cfactor: int | Sequence[int] = 2,
        fwd_iters: int = 2,
        bwd_iters: int = 2,
        tol: float = 1e-9,
        relax: str = "FCF",
        nrelax: int = 1,
        fwd_levels: int | None = None,
        bwd_levels: int | None = None,
        fwd_tol: float | None = None,
        bwd_tol: float | None = None,
        fine_relax: str | None = None,
        cycle_type: str = "V",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        batched: bool = True,
    ) -> None:
        super().__init__()
        drop: object = dropout  # checked as any value, as nn.GRU does
        if isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop <= 1:
            raise MGRITConfigError(
                f"dropout must be a number in [0, 1] (the probability of zeroing an element "
                f"of a layer's output), got dropout={dropout!r}"
            )
        self.input_size = _int_arg(input_size, "input_size")
        self.hidden_size = _int_arg(hidden_size, "hidden_size")
        self.num_layers = _int_arg(num_layers, "num_layers")
        if dropout > 0 and self.num_layers == 1:
            warnings.warn(
                f"ParallelGRU: dropout={dropout} acts between layers only (as torch.nn.GRU's), "
                "so with num_layers=1 it does nothing; use num_layers > 1 or dropout=0",
                UserWarning,
                stacklevel=2,
            )
        self.seq_len = None if seq_len is None else _int_arg(seq_len, "seq_len")
        self.batched = bool(batched)
        self.bias, self.batch_first = bool(bias), bool(batch_first)
        self.dropout, self.bidirectional = float(dropout), bool(bidirectional)
        self.comm = as_communicator(comm)
        # torch.nn.GRU's own parameters and initialisation, under its names.
        template = nn.GRU(input_size, hidden_size, num_layers, bias=bias,
                          bidirectional=self.bidirectional, device=device,
                          dtype=dtype)  # fmt: skip
        self._names = [name for name, _ in template.named_parameters()]
        for name, p in template.named_parameters():
            self.register_parameter(name, nn.Parameter(p.detach().clone()))
        if self.comm.size > 1:
            with torch.no_grad():
                for p in self.parameters():
                    buf = p.detach().to("cpu", copy=True).contiguous()
                    p.copy_(broadcast(buf, 0, comm=self.comm))
        self.config: dict[str, Any] = {
            "levels": levels, "cfactor": cfactor, "fwd_iters": fwd_iters, "bwd_iters": bwd_iters,
            "tol": tol, "relax": relax, "nrelax": nrelax, "fwd_levels": fwd_levels,
            "bwd_levels": bwd_levels, "fwd_tol": fwd_tol, "bwd_tol": bwd_tol,
            "fine_relax": fine_relax, "cycle_type": cycle_type,
        }  # fmt: skip
        self._unit = self._coarsest_interval()
        self._grids: dict[int, list[_Direction]] = {}
        self._last: list[_Direction] | None = None
        if self.seq_len is not None:
            self._grid(self.seq_len)

    def flatten_parameters(self) -> None:
        """Nothing to do (torch.nn.GRU's cuDNN layout hook, kept for drop-in use)."""

    def layer_weights(self, layer: int, reverse: bool = False) -> Weights:
        """``(weight_ih, weight_hh, bias_ih, bias_hh)`` of ``layer`` (biases None without bias)."""
        get, tail = self._parameters.get, "_reverse" if reverse else ""
        w_ih, w_hh = get(f"weight_ih_l{layer}{tail}"), get(f"weight_hh_l{layer}{tail}")
        assert w_ih is not None
        assert w_hh is not None
        return w_ih, w_hh, get(f"bias_ih_l{layer}{tail}"), get(f"bias_hh_l{layer}{tail}")

    def padded_length(self, seq_len: int) -> int:
        """The grid's length for a sequence of ``seq_len`` steps (padded with identity steps)."""
        return -(-seq_len // self._unit) * self._unit

    def _coarsest_interval(self) -> int:
        """Fine steps per coarsest interval of both grids (their least common multiple)."""
        spans = []
        for key in ("fwd_levels", "bwd_levels"):
            name = key if self.config[key] is not None else "levels"
            levels = _levels_arg(self.config[name], name)
            spans.append(math.prod(coarsening_factors(self.config["cfactor"], levels)))
        return math.lcm(*spans)

    def _grid(self, seq_len: int) -> list[_Direction]:
        grid = self._grids.get(seq_len)
        if grid is None:
            padded = self.padded_length(seq_len)
            try:
                forward = _Direction(
                    False, seq_len, padded, self.comm, None, self.config, self.batched
                )
                grid = [forward]
                if self.bidirectional:
                    # The reverse direction on the adjoint's reversed ranks, blocks mirrored:
                    # each rank holds the same positions in both directions.
                    fs = forward.stepper
                    blocks = (fs.fwd.layout.blocks[::-1], fs.bwd.layout.blocks)
                    grid.append(
                        _Direction(True, seq_len, padded, fs.rcomm, blocks, self.config,
                                   self.batched)
                    )  # fmt: skip
            except MGRITConfigError as err:
                raise MGRITConfigError(f"sequence length {seq_len}: {err}") from err
            self._grids[seq_len] = grid
        return grid

    def forward(
        self, input: torch.Tensor, hx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, h_n)`` as :class:`torch.nn.GRU` returns them, on every rank. Collective."""
        batched = input.dim() == 3
        if input.dim() not in (2, 3) or input.shape[-1] != self.input_size:
            raise MGRITConfigError(
                f"ParallelGRU(input_size={self.input_size}) expects input of shape "
                f"({'batch, seq' if self.batch_first else 'seq, batch'}, {self.input_size}) "
                f"or (seq, {self.input_size}), got {tuple(input.shape)}"
            )
        x = input if batched else input.unsqueeze(1)
        if batched and self.batch_first:
            x = x.transpose(0, 1)  # time-major inside: (T, B, in)
        seq_len, batch = x.shape[0], x.shape[1]
        if seq_len == 0 or (self.seq_len is not None and seq_len != self.seq_len):
            want = "at least 1" if self.seq_len is None else str(self.seq_len)
            raise MGRITConfigError(
                f"ParallelGRU was built for seq_len={self.seq_len}, got a sequence of "
                f"{seq_len} steps; pass sequences of {want} steps"
                + ("" if self.seq_len is None else " or build it without seq_len")
            )
        dirs = 2 if self.bidirectional else 1
        shape = (self.num_layers * dirs, batch, self.hidden_size)
        if hx is None:
            hx = x.new_zeros(shape)
        elif not batched:
            hx = hx.unsqueeze(1)
        if tuple(hx.shape) != shape:
            what = "2 * num_layers" if self.bidirectional else "num_layers"
            raise MGRITConfigError(
                f"hx must have shape ({what}, batch, hidden_size) = {shape}, got {tuple(hx.shape)}"
            )
        grid = self._grid(seq_len)
        self._last = grid
        inputs: torch.Tensor = x
        offset: int | None = None
        finals = []
        for layer in range(self.num_layers):
            outs = []
            for d, direction in enumerate(grid):
                weights = self.layer_weights(layer, direction.reverse)
                params = [w for w in weights if w is not None]
                block, h_last = _Layer.apply(  # type: ignore[no-untyped-call]
                    direction, weights, inputs, offset, hx[layer * dirs + d], *params
                )
                # The reverse direction's rows run backwards in position.
                outs.append(block.flip(0) if direction.reverse else block)
                finals.append(h_last)
            inputs = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
            if self.training and self.dropout > 0 and layer < self.num_layers - 1:
                inputs = self._drop(inputs, grid[0].stepper.first, seq_len)
            offset = grid[0].stepper.first
        stepper = grid[0].stepper
        gathered: torch.Tensor = _Gather.apply(stepper, inputs)  # type: ignore[no-untyped-call]
        output = gathered[:seq_len]
        h_n = torch.stack(finals)
        if not batched:
            return output.squeeze(1), h_n.squeeze(1)
        return (output.transpose(0, 1) if self.batch_first else output), h_n

    def _drop(self, block: torch.Tensor, first: int, seq_len: int) -> torch.Tensor:
        """Dropout on this rank's rows (positions ``first...``) of a layer's output.

        The mask is drawn for the whole output, as torch.nn.GRU draws it (the same
        calls on the default generator), and every rank draws it, so the generator
        stays in step across ranks and layers.
        """
        p = self.dropout
        if p == 1:
            return block * block.new_zeros(())
        noise = block.new_empty((seq_len, *block.shape[1:])).bernoulli_(1 - p).div_(1 - p)
        real = max(0, min(block.shape[0], seq_len - first))  # rows past T are padding
        return torch.cat([block[:real] * noise[first : first + real], block[real:]])

    def fwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last forward solve (the last layer's)."""
        fwd = self._last_stepper().fwd
        return {"iterations": fwd.iterations, "residuals": fwd.residuals}

    def bwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last adjoint solve (the first layer's)."""
        bwd = self._last_stepper().bwd
        return {"iterations": bwd.iterations, "residuals": bwd.residuals}

    def _work_steppers(self) -> list[TimeStepper]:
        """The solvers of the last sequence length run (:func:`mpx.mgrit.work` sums them)."""
        return [] if self._last is None else [d.stepper for d in self._last]

    def _last_stepper(self) -> TimeStepper:
        """The forward direction's solver of the last sequence length run."""
        if self._last is None:
            raise MGRITConfigError("no sequence was solved yet; call the module first")
        return self._last[0].stepper


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


class _Layer(torch.autograd.Function):
    """One direction of one GRU layer: this rank's states and the final state, with the adjoint.

    ``inputs`` is the whole sequence (layer 0, replicated on every rank: ``offset``
    None) or this rank's block of the previous layer's output (``offset`` = the
    position of its first row). Which one is said, not guessed from shapes: a rank
    whose block is the whole sequence must still sum the input gradient with the others.
    """

    @staticmethod
    def forward(
        ctx: Any,
        direction: _Direction,
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
        direction: _Direction = ctx.direction
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


class _Gather(torch.autograd.Function):
    """Every rank's block of states, in time order, on every rank; backward: this rank's slice."""

    @staticmethod
    def forward(ctx: Any, stepper: TimeStepper, block: torch.Tensor) -> Any:
        ctx.steps = stepper.owned_steps()
        comm = stepper.comm
        if comm.size == 1:
            return block.clone()
        span = stepper.fwd.layout.nt // sum(stepper.fwd.layout.blocks)
        counts = [b * span for b in stepper.fwd.layout.blocks]
        padded = block.new_zeros((max(counts), *block.shape[1:]), device="cpu")
        padded[: block.shape[0]] = block
        every = allgather(padded, comm=comm)
        return torch.cat([every[r, :c] for r, c in enumerate(counts)]).to(block.device)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        # Every rank computes the same loss of the whole output: its block's share is its slice.
        return None, grad[ctx.steps.start : ctx.steps.stop].clone()
