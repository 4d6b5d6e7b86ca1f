"""A GRU over a long sequence, parallel in time: the sequence is split over ranks.

The recurrence ``h_{k+1} = GRUCell(x_k, h_k)`` is a time-stepping problem with
step size 1, so MGRIT solves it across ranks (Moon & Cyr 2022). Written as

    h_{k+1} = h_k + (1 - z_k) (n_k - h_k)           (the GRU cell exactly)

its coarse levels take a step of size ``m`` implicitly in the decay term, which
stays stable for any ``m``:

    h_{k+m} = (h_k + m (1 - z_k) n_k) / (1 + m (1 - z_k))

with the gates ``z_k, n_k`` of the input at the coarse step's start. The fine
level is the GRU cell itself, so a converged solve is the serial loop. The cell
is replicated on every rank; its gradients (and those of the input sequence)
are summed over ranks, so every rank ends with the same gradients::

    x:   [x_0 ... x_a) [x_a ... x_b) [x_b ... x_T)   (the whole sequence on every rank)
    h:    rank 0         rank 1        rank 2        -> h_T broadcast to every rank
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from mpx.collectives import Communicator, broadcast, world
from mpx.mgrit.adjoint import TimeStepper
from mpx.mgrit.errors import MGRITConfigError

__all__ = ["ParallelGRU", "gru_step"]


def _gates(cell: nn.GRUCell, x: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The update gate z and the candidate n of ``cell`` at input x and state h."""
    gi = nn.functional.linear(x, cell.weight_ih, cell.bias_ih)
    gh = nn.functional.linear(h, cell.weight_hh, cell.bias_hh)
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    r = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + r * h_n)
    return z, n


def gru_step(cell: nn.GRUCell, x: torch.Tensor, h: torch.Tensor, dt: float) -> torch.Tensor:
    """One step of size ``dt``: the GRU cell for dt = 1, the implicit coarse step otherwise."""
    if dt == 1.0:
        out: torch.Tensor = cell(x, h)
        return out
    z, n = _gates(cell, x, h)
    a = dt * (1 - z)
    return (h + a * n) / (1 + a)


class ParallelGRU(nn.Module):
    """A GRU cell run over a sequence whose time steps are split over ranks.

    Args:
        input_size, hidden_size: as for :class:`torch.nn.GRUCell`.
        seq_len: the sequence length T (the number of time steps).
        comm: the ranks that share the sequence (default: all).
        levels, cfactor, fwd_iters, bwd_iters, tol, relax, nrelax: MGRIT settings.

    ``forward(x, h0=None)`` takes the whole batch-first sequence ``(B, T, input_size)``
    on every rank and returns the last hidden state ``h_T`` on every rank. The cell's
    weights are broadcast from rank 0 at construction.

    Example::

        gru = ParallelGRU(3, 8, seq_len=64, levels=2, cfactor=4, fwd_iters=3, bwd_iters=3)
        h_T = gru(torch.randn(5, 64, 3))
        h_T.sum().backward()
    """

    def __init__(
        self,
        input_size: int,
        hidden_size: int,
        seq_len: int,
        comm: Communicator | None = None,
        levels: int = 2,
        cfactor: int | Sequence[int] = 2,
        fwd_iters: int = 2,
        bwd_iters: int = 2,
        tol: float = 1e-9,
        relax: str = "FCF",
        nrelax: int = 1,
    ) -> None:
        super().__init__()
        self.comm = world() if comm is None else comm
        self.cell = nn.GRUCell(input_size, hidden_size)
        self.seq_len, self.hidden_size = seq_len, hidden_size
        if self.comm.size > 1:
            with torch.no_grad():
                for p in self.cell.parameters():
                    p.copy_(broadcast(p.detach().contiguous(), 0, comm=self.comm))
        self.stepper = TimeStepper(
            self._phi, self._uses, seq_len, float(seq_len), comm=self.comm, levels=levels,
            cfactor=cfactor, fwd_iters=fwd_iters, bwd_iters=bwd_iters, tol=tol, relax=relax,
            nrelax=nrelax, skip_downcycle=True, shared=True, context=(self._save, self._restore),
        )  # fmt: skip
        self._x: torch.Tensor | None = None
        self._tensors: list[torch.Tensor] = []

    def _save(self) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        return self._x, self._tensors

    def _restore(self, saved: tuple[torch.Tensor | None, list[torch.Tensor]]) -> None:
        self._x, self._tensors = saved

    def _phi(self, k: int, h: torch.Tensor, dt: float) -> torch.Tensor:
        assert self._x is not None
        return gru_step(self.cell, self._x[:, k], h, dt)

    def _uses(self, k: int) -> list[int]:
        return list(range(len(self._tensors)))

    def forward(self, x: torch.Tensor, h0: torch.Tensor | None = None) -> torch.Tensor:
        if x.dim() != 3 or x.shape[1] != self.seq_len:
            raise MGRITConfigError(
                f"ParallelGRU expects x of shape (batch, seq_len={self.seq_len}, input), "
                f"got {tuple(x.shape)}"
            )
        if h0 is None:
            h0 = x.new_zeros((x.shape[0], self.hidden_size))
        self._x = x
        self._tensors = [p for p in self.cell.parameters() if p.requires_grad]
        if x.requires_grad:
            self._tensors.append(x)
        return self.stepper.apply(h0, self._tensors)

    def fwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last forward solve."""
        return {"iterations": self.stepper.fwd.iterations, "residuals": self.stepper.fwd.residuals}

    def bwd_stats(self) -> dict[str, object]:
        """Iterations and residual history of the last adjoint solve."""
        return {"iterations": self.stepper.bwd.iterations, "residuals": self.stepper.bwd.residuals}
