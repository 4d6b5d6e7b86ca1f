"""The work count of a layer-parallel training step, pinned by hand at any rank count.

The small config: N = 16 steps, 3 levels, cfactor 2, one forward and one adjoint
V-cycle, F-relaxation, nested start (skip_downcycle). The coarsest level has
16 / 4 = 4 intervals, split evenly: 1 rank [4], 2 ranks [2, 2], 3 ranks [2, 1, 1].
A rank with b coarsest intervals holds n0 = 4b fine, n1 = 2b and n2 = b coarse
points. Its forward solve steps (rows):

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
(n0 = 4b). To differentiate, the batched (stacked) layers linearise each owned
step once (4b forward evaluations, whatever the level and iteration); one
module call per step (batched=False) replays the step's forward before each
product: 21b + 4b.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.mgrit import LayerParallel, MGRITTypeError, work

pytestmark = pytest.mark.mpi

BLOCKS = {1: [4], 2: [2, 2], 3: [2, 1, 1]}


def _net(batched: bool = True) -> LayerParallel:
    torch.manual_seed(0)
    return LayerParallel(
        nn.Identity(), lambda: nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Identity(),
        num_steps=16, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, tol=0.0, batched=batched,
    )  # fmt: skip


@pytest.mark.parametrize(("batched", "linearize"), [(True, 4), (False, 25)])
def test_work_of_one_training_step_is_the_algorithms(batched: bool, linearize: int) -> None:
    comm = world()
    if comm.size not in BLOCKS:
        pytest.skip("the hand count covers 1, 2 and 3 ranks")
    b = BLOCKS[comm.size][comm.rank]
    net = _net(batched)
    net(torch.randn(3, 4)).square().sum().backward()
    got = work(net)
    assert got == {
        "forward": 21 * b, "adjoint": 21 * b, "linearize": linearize * b, "gradient": 4 * b
    }, got  # fmt: skip
    assert len(net.owned_steps()) == 4 * b


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
