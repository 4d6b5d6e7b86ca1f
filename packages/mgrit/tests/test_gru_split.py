"""ParallelGRU on the fine split: on any rank count, what one rank computes.

The fine grid is split over the ranks in whole fine C-intervals, not whole
coarsest intervals, so ranks outnumber the coarsest intervals, blocks start
between coarse points, the reverse direction's padding spreads over several
blocks, and a rank takes the steps at its block's edges with its neighbours'
input rows, states and adjoint sources. None of this may change what MGRIT
computes: on inexact solves (one or two iterations, where every step of the
algorithm shows in the result) the module on all ranks equals the same module
on one rank (``MPI.COMM_SELF``) to rounding, in the output, h_n and every
gradient.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import world
from mpx.mgrit import ParallelGRU

pytestmark = pytest.mark.mpi


def tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _run(comm: Any, layers: int, bidirectional: bool, seq_len: int, dropout: float,
         settings: dict[str, Any]) -> tuple[list[torch.Tensor], ParallelGRU]:  # fmt: skip
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, layers, bidirectional=bidirectional, dropout=dropout, comm=comm,
                      tol=0.0, **settings).double()  # fmt: skip
    x = tensor(seq_len, 4, 3, seed=1).requires_grad_(True)
    hx = tensor(layers * (2 if bidirectional else 1), 4, 5, seed=2).requires_grad_(True)
    torch.manual_seed(7)  # the dropout masks: the same on every rank and in both runs
    out, h_n = gru(x, hx)
    ((out * tensor(*out.shape, seed=9)).sum() + h_n.square().sum()).backward()
    assert x.grad is not None
    assert hx.grad is not None
    grads = [p.grad for p in gru.parameters()]
    assert all(g is not None for g in grads)
    return [out.detach(), h_n.detach(), x.grad, hx.grad, *(g for g in grads if g is not None)], gru


F_CYCLES = {"fwd_levels": 3, "bwd_levels": 2, "cfactor": 2, "relax": "FCF", "cycle_type": "F"}
F_CYCLES |= {"fwd_iters": 1, "bwd_iters": 1}


@pytest.mark.parametrize(
    ("seq_len", "layers", "bidirectional", "dropout", "settings"),
    [
        # 64 steps, 4 levels: 8 coarsest intervals, blocks of 2-step C-intervals
        (64, 2, True, 0.0, {"levels": 4, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 1}),
        # 17 padded to 24: 7 identity steps, first in the reverse direction's time
        (17, 3, True, 0.0, {"levels": 4, "cfactor": 2, "fwd_iters": 2, "bwd_iters": 1}),
        # 8 steps, 3 levels: two coarsest intervals, four fine C-intervals
        (8, 2, False, 0.0, {"levels": 3, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 2}),
        # different forward and adjoint grids, F-cycles, FCF, dropout in training
        (40, 2, True, 0.3, F_CYCLES),
        (30, 1, True, 0.0, {"levels": 3, "cfactor": 3, "relax": "F", "fwd_iters": 1}),
        (27, 2, False, 0.0, {"levels": 2, "cfactor": 4, "batched": False, "fwd_iters": 1}),
        # at 5 ranks and more a coarse level's row 0 is a point whose step reads the edge
        # rows the layer below shared (at 1-3 ranks these steps never count)
        (32, 2, True, 0.0, {"levels": 3, "cfactor": 3, "fwd_iters": 1, "bwd_iters": 1}),
    ],
)
def test_inexact_solves_on_all_ranks_equal_one_rank(
    seq_len: int, layers: int, bidirectional: bool, dropout: float, settings: dict[str, Any]
) -> None:
    mine, gru = _run(None, layers, bidirectional, seq_len, dropout, settings)
    alone, single = _run(MPI.COMM_SELF, layers, bidirectional, seq_len, dropout, settings)
    # Inexact: far from the converged network, so every step of the algorithm counts.
    single.close()
    torch.manual_seed(0)
    exact = ParallelGRU(3, 5, layers, bidirectional=bidirectional, comm=MPI.COMM_SELF,
                        levels=1).double()  # fmt: skip
    exact.load_state_dict(gru.state_dict())
    exact.eval()
    gru.eval()
    x = tensor(seq_len, 4, 3, seed=1)
    assert (gru(x)[0] - exact(x)[0]).abs().max() > 1e-6
    for a, b in zip(mine, alone, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    gru.close()
    exact.close()


def test_ranks_beyond_the_coarsest_intervals_all_work() -> None:
    # 16 steps, 3 levels, cfactor 2: 4 coarsest intervals, 8 fine C-intervals: up to 8
    # ranks hold steps (the coarsest split held at most 4).
    gru = ParallelGRU(3, 5, levels=3, cfactor=2)
    gru(tensor(16, 2, 3, seed=1).float())
    blocks = gru._last_stepper().fwd.layout.blocks
    size = world().size
    assert sum(blocks) == 16
    assert sum(b > 0 for b in blocks) == min(size, 8)
    assert all(b % 2 == 0 for b in blocks)  # whole fine C-intervals, as even as they go
    assert max(blocks) - min(b for b in blocks if b > 0) <= 2
    gru.close()
