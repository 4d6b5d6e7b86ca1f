"""The work count of a layer-parallel training step, pinned by hand at any rank count.

The small config: N = 16 steps, 3 levels, cfactor 2, one forward and one adjoint
V-cycle, F-relaxation, nested start (skip_downcycle). The fine grid is split in
whole fine C-intervals: 1 rank [16], 2 ranks [8, 8], 3 ranks [6, 6, 4].

At 1 and 2 ranks every block is whole coarsest intervals (b = 4 or 2 of them):
a rank holds n0 = 4b fine, n1 = 2b and n2 = b coarse points. Its forward solve
steps (rows):

    nested start  coarsest solve (level 2)                               b
                  level 1 V-cycle: F-relax n1/2 = b, restrict (fine C-points
                  b + coarse steps b), coarsest b, final F-relax b        5b
    iteration 1   F-relax level 0: n0/2 = 2b; restrict: C-points 2b and the
                  level-1 steps n1 = 2b; the level-1 V-cycle 5b; final
                  F-relax 2b                                            13b
    residual      the fine C-points                                     2b
                                                                 total  21b

The adjoint solve runs the same grid backwards over the same blocks: 21b
vector-Jacobian products; the final sweep one parameter product per owned step
(n0 = 4b).

At 3 ranks the blocks (0, 6], (6, 12], (12, 16] cut coarse intervals. Per rank
(points, F-points, C-points) on level 0 / level 1, then points on level 2:
rank 0 (6, 3, 3) / (3, 2, 1) / 1; rank 1 (6, 3, 3) / (3, 1, 2) / 2; rank 2
(4, 2, 2) / (2, 1, 1) / 1. Rank 1's row 0 on level 2 is point 1 (fine 4: rank
0's layer): rank 0 steps it and sends the result (boundary steps) each time it
sends on level 2 (once per coarsest solve, once per restriction to level 2),
and rank 1 does not step it. Per rank 0 / 1 / 2:

    coarsest solve                                              2 / 1 / 1
    level-1 V-cycle: F-relax, restrict, coarsest, F-relax       9 / 6 / 5
    nested start: coarsest + level-1 V-cycle                   11 / 7 / 6
    iteration: F-relax 3/3/2, restrict 6/6/4, V-cycle, F-relax 21 / 18 / 13
    residual                                                    3 / 3 / 2
                                                       forward 35 / 28 / 21

The adjoint's blocks are reversed ([4, 6, 6] in its rank order): forward rank 1
plays rank 0's part there and rank 0 rank 1's, adjoint 28 / 35 / 21.

To differentiate, the batched (stacked) layers linearise each owned step once
(whatever the level and iteration); one module call per step (batched=False)
replays the step's forward before each adjoint product and each gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.mgrit import LayerParallel, MGRITTypeError, work

pytestmark = pytest.mark.mpi

BLOCKS = {1: [4], 2: [2, 2]}  # coarsest intervals a rank holds (1, 2 ranks)
# (forward, adjoint, owned steps) of each rank at 3 ranks (see the module doc).
THREE_RANKS = [(35, 28, 6), (28, 35, 6), (21, 21, 4)]


def _net(batched: bool = True) -> LayerParallel:
    torch.manual_seed(0)
    return LayerParallel(
        nn.Identity(), lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Identity(),
        num_steps=16, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, tol=0.0, batched=batched,
    )  # fmt: skip


@pytest.mark.parametrize("batched", [True, False])
def test_work_of_one_training_step_is_the_algorithms(batched: bool) -> None:
    comm = world()
    if comm.size == 3:
        fwd, adj, owned = THREE_RANKS[comm.rank]
    elif comm.size in BLOCKS:
        b = BLOCKS[comm.size][comm.rank]
        fwd, adj, owned = 21 * b, 21 * b, 4 * b
    else:
        pytest.skip("the hand count covers 1, 2 and 3 ranks")
    net = _net(batched)
    net(torch.randn(3, 4)).square().sum().backward()
    got = work(net)
    # Stacked: one linearisation per owned step; one module call a step: a forward
    # replayed per adjoint product and per gradient.
    lin = owned if batched else adj + owned
    assert got == {"forward": fwd, "adjoint": adj, "linearize": lin, "gradient": owned}, got
    assert len(net.owned_steps()) == owned


def test_forward_alone_counts_no_backward_work() -> None:
    net = _net()
    with torch.no_grad():
        net(torch.randn(3, 4))
    got = work(net)
    assert got["adjoint"] == got["gradient"] == got["linearize"] == 0, got
    assert got["forward"] > 0


def test_work_of_something_else_is_a_type_error() -> None:
    with pytest.raises(MGRITTypeError, match="LayerParallel or a ParallelGRU"):
        work(nn.Linear(2, 2))
