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

The fine grid is split evenly over the ranks (whole fine C-intervals,
:mod:`mpx.mgrit.solver.grid`), so any rank count up to the number of fine
C-intervals works at any depth. A rank also takes the steps at its block's
edges (from its last point forward, and the step before its block in the
adjoint, :mod:`mpx.mgrit.solver.boundaries`), so it holds one input row of each
neighbour besides its block: layer l+1's inputs are its block of layer l's
states with the left neighbour's last row and the right neighbour's first row.

**Any length.** The grid needs whole coarsest intervals (every coarse point is a
fine point), so a sequence of T steps is padded to P, the next multiple of the
coarsest interval, with *identity* steps at positions T..P-1. An identity step is
exact on every level (a coarse step over padding only is the identity too, and
one that reaches into the padding steps only over its real part, with the gates
of its own position: a zero input's where that is padding), so the
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
from typing import Any, Unpack

import torch
from torch import nn

from mpx.collectives import broadcast
from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.adjoint import TimeStepper
from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.gru.gru_layer import Direction, Gather, Layer, Weights, gru_step
from mpx.mgrit.solver import MGRITOptions, MGRITSettings, coarsening_factors, resolve

__all__ = ["ParallelGRU", "gru_step"]


def _int_arg(value: int, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MGRITConfigError(f"{name} must be an int >= 1, got {name}={value!r}")
    return value


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
        options: the MGRIT settings (:class:`~mpx.mgrit.MGRITOptions`), or
        **settings: the same as keywords (``levels=2, cfactor=4, fwd_iters=3``), not both;
            unset ones are :attr:`defaults`', which differ from LayerParallel's in
            ``relax="FCF"`` and ``bwd_iters=2``.
        batched: run the j-th steps of all C-intervals of a rank as one cell over the
            stacked rows, the input projections precomputed, and each adjoint step as
            one vector-Jacobian product of a linearisation (see
            :mod:`mpx.mgrit.adjoint.gru_steps`); False: one cell call per step, the adjoint
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
        gru.close()    # collective, when done: frees the solvers' communicators

    Each sequence length run builds the solvers of its grid, each with a
    communicator of its own (the adjoint's, ranks reversed): :meth:`close` frees them.
    """

    #: the settings a ParallelGRU made without ``options=`` starts from: FCF relaxation
    #: and 2 adjoint cycles (LayerParallel's are F and 1)
    defaults = MGRITOptions(bwd_iters=2, relax="FCF")

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
        options: MGRITOptions | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        batched: bool = True,
        **settings: Unpack[MGRITSettings],
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
        #: the MGRIT settings of every layer's and direction's forward and adjoint solve
        self.options = resolve("ParallelGRU", options, settings, self.defaults)
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
        self._unit = self._coarsest_interval()
        self._grids: dict[int, list[Direction]] = {}
        self._last: list[Direction] | None = None
        self._closed = False
        if self.seq_len is not None:
            self._grid(self.seq_len)

    @property
    def config(self) -> dict[str, Any]:
        """The MGRIT settings by name (a copy of :attr:`options`)."""
        return self.options.as_dict()

    def close(self) -> None:
        """Frees the communicators of every grid built so far. Collective, idempotent.

        Every rank calls it, when done with the module (the grids, one per sequence
        length run, are the same on every rank, as the ranks run the same lengths);
        a second call does nothing. ``comm`` itself is the caller's and stays.
        Afterwards the forward pass raises :class:`~mpx.mgrit.MGRITConfigError`.
        """
        if self._closed:
            return
        self._closed = True
        for grid in self._grids.values():
            # The reverse direction's communicator was split off the forward's: first.
            for direction in reversed(grid):
                direction.stepper.close()

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
        opts = self.options
        spans = [
            math.prod(coarsening_factors(opts.cfactor, levels))
            for levels in (opts.forward_levels, opts.adjoint_levels)
        ]
        return math.lcm(*spans)

    def _grid(self, seq_len: int) -> list[Direction]:
        grid = self._grids.get(seq_len)
        if grid is None:
            padded = self.padded_length(seq_len)
            grid = []
            try:
                forward = Direction(
                    False, seq_len, padded, self.comm, None, self.options, self.batched
                )
                grid.append(forward)
                if self.bidirectional:
                    # The reverse direction on the adjoint's reversed ranks, blocks mirrored:
                    # each rank holds the same positions in both directions.
                    fs = forward.stepper
                    blocks = (fs.fwd.layout.blocks[::-1], fs.bwd.layout.blocks)
                    grid.append(
                        Direction(True, seq_len, padded, fs.rcomm, blocks, self.options,
                                   self.batched)
                    )  # fmt: skip
            except MGRITConfigError as err:
                # The same error on every rank: each frees what this grid made so far.
                for made in reversed(grid):
                    made.stepper.close()
                raise MGRITConfigError(f"sequence length {seq_len}: {err}") from err
            self._grids[seq_len] = grid
        return grid

    def forward(
        self, input: torch.Tensor, hx: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(output, h_n)`` as :class:`torch.nn.GRU` returns them, on every rank. Collective."""
        if self._closed:
            raise MGRITConfigError(
                "this ParallelGRU was closed: close() freed its MGRIT communicators, so it "
                "cannot run any more; build a new one (and close() it when done)"
            )
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
        block = x  # each layer's output on this rank's block (its last: the output)
        for layer in range(self.num_layers):
            outs = []
            for d, direction in enumerate(grid):
                weights = self.layer_weights(layer, direction.reverse)
                params = [w for w in weights if w is not None]
                rows, h_last = Layer.apply(  # type: ignore[no-untyped-call]
                    direction, weights, inputs, offset, hx[layer * dirs + d], *params
                )
                # The reverse direction's rows run backwards in position.
                outs.append(rows.flip(0) if direction.reverse else rows)
                finals.append(h_last)
            block = outs[0] if dirs == 1 else torch.cat(outs, dim=-1)
            if layer < self.num_layers - 1:
                if self.training and self.dropout > 0:
                    block = self._drop(block, grid[0].stepper.first, seq_len)
                inputs, offset = self._with_edges(grid[0], block)
        stepper = grid[0].stepper
        gathered: torch.Tensor = Gather.apply(stepper, block)  # type: ignore[no-untyped-call]
        output = gathered[:seq_len]
        h_n = torch.stack(finals)
        if not batched:
            return output.squeeze(1), h_n.squeeze(1)
        return (output.transpose(0, 1) if self.batch_first else output), h_n

    @staticmethod
    def _with_edges(forward: Direction, block: torch.Tensor) -> tuple[torch.Tensor, int]:
        """This rank's block of a layer's output with the rows its boundary steps read
        (the left neighbour's last, the right one's first: the next layer's inputs at
        positions ``first - 1`` and ``stop``), and the position of the first row."""
        first = forward.stepper.first
        if forward.halo is None or block.shape[0] == 0:
            return block, first
        before, after = forward.halo.share_edges(block[0], block[-1])
        parts = [block]
        if before is not None:
            parts.insert(0, before.unsqueeze(0))
            first -= 1
        if after is not None:
            parts.append(after.unsqueeze(0))
        # The edge rows carry no gradient back: only the MGRIT iterations read them,
        # and the final fine sweep differentiates this rank's own steps alone.
        return torch.cat(parts), first

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
