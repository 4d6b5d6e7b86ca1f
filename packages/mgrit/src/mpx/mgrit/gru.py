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

The weights are replicated (broadcast from rank 0 at construction); their
gradients, and the input's, are summed over ranks, so every rank ends with the
same gradients. The adjoint of a loss of every output step is an MGRIT solve
with a source term (:meth:`mpx.mgrit.adjoint.TimeStepper.adjoint`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, allgather, allreduce, broadcast
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.adjoint import TimeStepper
from mpx.mgrit.errors import MGRITConfigError

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


class ParallelGRU(nn.Module):
    """:class:`torch.nn.GRU` with the time steps of the sequence split over ranks.

    Args:
        input_size, hidden_size, num_layers, bias, batch_first: as for
            :class:`torch.nn.GRU`; the parameters have its names (``weight_ih_l0``...),
            so state dicts load both ways, and under the same seed the weights are
            the ones ``torch.nn.GRU`` draws.
        dropout, bidirectional: only 0.0 and False (an error says what to do instead).
        seq_len: if given, every input must have this length (else any length
            that the grid allows: a multiple of the coarsening factors' product).
        comm: the ranks that share the sequence (default: all); an mpx Communicator or an
            mpi4py one (``MPI.COMM_WORLD``, as torchbraid takes it).
        levels, cfactor, fwd_iters, bwd_iters, tol, relax, nrelax: MGRIT settings,
            as for :class:`~mpx.mgrit.LayerParallel` (as are fwd_levels, bwd_levels,
            fwd_tol, bwd_tol and fine_relax).

    ``forward(input, hx=None)`` takes the whole sequence on every rank, ``(T, B, in)``
    (``(B, T, in)`` with ``batch_first``, or ``(T, in)`` unbatched) and ``hx`` of shape
    ``(num_layers, B, hidden)``, and returns ``(output, h_n)`` on every rank: the
    last layer's state at every step and every layer's final state, as
    ``torch.nn.GRU`` does. Converged (``levels=1``, or enough iterations) it is
    ``torch.nn.GRU`` to rounding.

    Example::

        gru = ParallelGRU(3, 8, num_layers=2, batch_first=True, levels=2, cfactor=4,
                          fwd_iters=3, bwd_iters=3)
        output, h_n = gru(torch.randn(5, 64, 3))      # (5, 64, 8), (2, 5, 8)
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
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dropout != 0.0:
            raise MGRITConfigError(
                f"ParallelGRU has no dropout between layers, got dropout={dropout!r}; use "
                "dropout=0.0 and stack single-layer ParallelGRUs with nn.Dropout between them"
            )
        if bidirectional:
            raise MGRITConfigError(
                "ParallelGRU is not bidirectional, got bidirectional=True; run a second "
                "ParallelGRU on input.flip(time dim) and concatenate the outputs"
            )
        self.input_size = _int_arg(input_size, "input_size")
        self.hidden_size = _int_arg(hidden_size, "hidden_size")
        self.num_layers = _int_arg(num_layers, "num_layers")
        self.seq_len = None if seq_len is None else _int_arg(seq_len, "seq_len")
        self.bias, self.batch_first = bool(bias), bool(batch_first)
        self.dropout, self.bidirectional = 0.0, False
        self.comm = as_communicator(comm)
        # torch.nn.GRU's own parameters and initialisation, under its names.
        template = nn.GRU(input_size, hidden_size, num_layers, bias=bias, device=device,
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
            "fine_relax": fine_relax,
        }  # fmt: skip
        self._steppers: dict[int, TimeStepper] = {}
        # What the step of the layer being solved reads: its weights and its inputs
        # (x_k is inputs[k - offset]); set before every solve, forward and adjoint.
        self._layer: tuple[Weights, torch.Tensor, int] | None = None
        if self.seq_len is not None:
            self._stepper(self.seq_len)

    def flatten_parameters(self) -> None:
        """Nothing to do (torch.nn.GRU's cuDNN layout hook, kept for drop-in use)."""

    def layer_weights(self, layer: int) -> Weights:
        """``(weight_ih, weight_hh, bias_ih, bias_hh)`` of ``layer`` (biases None without bias)."""
        get = self._parameters.get
        w_ih, w_hh = get(f"weight_ih_l{layer}"), get(f"weight_hh_l{layer}")
        assert w_ih is not None
        assert w_hh is not None
        return w_ih, w_hh, get(f"bias_ih_l{layer}"), get(f"bias_hh_l{layer}")

    def _stepper(self, seq_len: int) -> TimeStepper:
        stepper = self._steppers.get(seq_len)
        if stepper is None:
            try:
                stepper = TimeStepper(
                    self._phi, lambda k: [], seq_len, float(seq_len), comm=self.comm,
                    skip_downcycle=True, **self.config,
                )  # fmt: skip
            except MGRITConfigError as err:
                raise MGRITConfigError(f"sequence length {seq_len}: {err}") from err
            self._steppers[seq_len] = stepper
        return stepper

    def _phi(self, k: int, h: torch.Tensor, dt: float) -> torch.Tensor:
        assert self._layer is not None
        weights, inputs, offset = self._layer
        return gru_step(weights, inputs[k - offset], h, dt)

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
        if self.seq_len is not None and seq_len != self.seq_len:
            raise MGRITConfigError(
                f"ParallelGRU was built for seq_len={self.seq_len}, got a sequence of "
                f"{seq_len} steps; pass sequences of {self.seq_len} steps or build it "
                "without seq_len"
            )
        shape = (self.num_layers, batch, self.hidden_size)
        if hx is None:
            hx = x.new_zeros(shape)
        elif not batched:
            hx = hx.unsqueeze(1)
        if tuple(hx.shape) != shape:
            raise MGRITConfigError(
                f"hx must have shape (num_layers, batch, hidden_size) = {shape}, "
                f"got {tuple(hx.shape)}"
            )
        stepper = self._stepper(seq_len)
        inputs: torch.Tensor = x
        offset: int | None = None
        finals = []
        for layer in range(self.num_layers):
            weights = self.layer_weights(layer)
            params = [w for w in weights if w is not None]
            block, h_last = _Layer.apply(  # type: ignore[no-untyped-call]
                self, stepper, weights, inputs, offset, hx[layer], *params
            )
            inputs, offset = block, stepper.first
            finals.append(h_last)
        output: torch.Tensor = _Gather.apply(stepper, inputs)  # type: ignore[no-untyped-call]
        h_n = torch.stack(finals)
        if not batched:
            return output.squeeze(1), h_n.squeeze(1)
        return (output.transpose(0, 1) if self.batch_first else output), h_n

    def fwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last forward solve (the last layer's)."""
        fwd = self._last_stepper().fwd
        return {"iterations": fwd.iterations, "residuals": fwd.residuals}

    def bwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last adjoint solve (the first layer's)."""
        bwd = self._last_stepper().bwd
        return {"iterations": bwd.iterations, "residuals": bwd.residuals}

    def _last_stepper(self) -> TimeStepper:
        if not self._steppers:
            raise MGRITConfigError("no sequence was solved yet; call the module first")
        return next(reversed(self._steppers.values()))


def _sum_over_ranks(tensors: list[torch.Tensor], comm: Communicator) -> list[torch.Tensor]:
    """Every tensor summed over the ranks, in one allreduce of their concatenation."""
    if comm.size == 1 or not tensors:
        return tensors
    flat = torch.cat([t.reshape(-1) for t in tensors]).to("cpu", copy=True)
    total = allreduce(flat, "sum", comm=comm).to(tensors[0].device)
    parts = torch.split(total, [t.numel() for t in tensors])
    return [part.view_as(t) for part, t in zip(parts, tensors, strict=True)]


class _Layer(torch.autograd.Function):
    """One GRU layer over the sequence: this rank's states and the final state, with the adjoint.

    ``inputs`` is the whole sequence (layer 0, replicated on every rank: ``offset``
    None) or this rank's block of the previous layer's states (``offset`` = the
    block's first step). Which one is said, not guessed from shapes: a rank whose
    block is the whole sequence must still sum the input gradient with the others.
    """

    @staticmethod
    def forward(
        ctx: Any,
        gru: ParallelGRU,
        stepper: TimeStepper,
        weights: Weights,
        inputs: torch.Tensor,
        offset: int | None,
        h0: torch.Tensor,
        *params: torch.Tensor,
    ) -> Any:
        ctx.replicated = offset is None
        offset = 0 if offset is None else offset
        gru._layer = (weights, inputs.detach(), offset)
        try:
            h_last, states = stepper.forward(h0)
        finally:
            gru._layer = None
        ctx.gru, ctx.stepper, ctx.weights, ctx.offset = gru, stepper, weights, offset
        ctx.save_for_backward(inputs.detach(), states)
        return states[1:].clone(), h_last

    @staticmethod
    def backward(ctx: Any, g_block: torch.Tensor | None, g_last: torch.Tensor | None) -> Any:
        gru: ParallelGRU = ctx.gru
        stepper: TimeStepper = ctx.stepper
        inputs, states = ctx.saved_tensors
        forcing = torch.zeros_like(states[1:]) if g_block is None else g_block.clone()
        if g_last is not None and stepper.comm.rank == stepper.fwd.layout.last_rank:
            forcing[-1] += g_last  # h_T is this rank's last point
        gru._layer = (ctx.weights, inputs, ctx.offset)
        try:
            lam_next = stepper.adjoint(states, forcing)
        finally:
            gru._layer = None
        # The final fine sweep, all of this rank's steps in one batched cell call.
        steps = stepper.owned_steps()
        params = [w for w in ctx.weights if w is not None]
        with torch.enable_grad():
            h = states[:-1].detach().requires_grad_(True)
            x = inputs[steps.start - ctx.offset : steps.stop - ctx.offset]
            x = x.detach().requires_grad_(True)
            n, batch = h.shape[0], h.shape[1:-1].numel()
            weights = tuple(w.detach().requires_grad_(True) if w is not None else None
                            for w in ctx.weights)  # fmt: skip
            flat_x, flat_h = x.reshape(n * batch, x.shape[-1]), h.reshape(n * batch, h.shape[-1])
            out = gru_step(weights, flat_x, flat_h, 1.0)  # type: ignore[arg-type]
            leaves = [h, x, *(w for w in weights if w is not None)]
            got = torch.autograd.grad(out, leaves, lam_next.reshape_as(out), allow_unused=True)
        g_h = got[0]
        g_params = [
            torch.zeros_like(p) if g is None else g for g, p in zip(got[2:], params, strict=True)
        ]
        comm = stepper.comm
        g_h0 = g_h[0] if steps.start == 0 and n > 0 else torch.zeros_like(states[0])
        if comm.size > 1:
            buf = g_h0.detach().to("cpu", copy=True).contiguous()
            broadcast(buf, stepper.fwd.layout.first_rank, comm=comm)
            g_h0 = buf.to(states.device)
        g_inputs = None
        if ctx.needs_input_grad[3]:
            part = torch.zeros_like(x) if got[1] is None else got[1].view_as(x)
            g_inputs = part if not ctx.replicated else _scatter_sum(part, inputs, steps, comm)
        g_params = _sum_over_ranks(g_params, comm)
        return (None, None, None, g_inputs, None, g_h0, *g_params)


def _scatter_sum(part: torch.Tensor, like: torch.Tensor, steps: range, comm: Communicator) -> Any:
    """The gradient of the whole (replicated) sequence: each rank's steps, summed over ranks."""
    full = torch.zeros_like(like)
    full[steps.start : steps.stop] = part
    return _sum_over_ranks([full], comm)[0]


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
