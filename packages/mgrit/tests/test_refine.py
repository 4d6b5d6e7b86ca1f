"""Multilevel initialisation: refined networks copy weights in time and converge (any ranks)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpx.mgrit import LayerParallel, MGRITConfigError, refine

pytestmark = pytest.mark.mpi


def coarse_net() -> LayerParallel:
    torch.manual_seed(0)
    steps = [nn.Sequential(nn.Linear(5, 5), nn.Tanh()) for _ in range(3)]
    net = LayerParallel(nn.Linear(2, 5), steps, nn.Linear(5, 2), 3, Tf=1.0, levels=1)
    return net.double()


def test_refined_steps_copy_the_coarse_step_of_their_time() -> None:
    coarse = coarse_net()
    fine = refine(coarse, levels=2, fwd_iters=8, bwd_iters=8)
    assert fine.num_steps == 6
    assert fine.config["levels"] == 2
    assert fine.config["fwd_iters"] == 8
    coarse_all, fine_all = coarse.gather_steps(), fine.gather_steps()
    for k, layer in enumerate(fine_all):
        for p, q in zip(layer.parameters(), coarse_all[k // 2].parameters(), strict=True):
            assert torch.equal(p, q)
    # Copies, not shared: training the fine network leaves the coarse one alone.
    assert all(p.data_ptr() != q.data_ptr() for p in fine.parameters() for q in coarse.parameters())


def test_refinement_converges_like_forward_euler() -> None:
    x = torch.randn(7, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    nets = [coarse_net()]
    for _ in range(3):
        nets.append(refine(nets[-1]))
    with torch.no_grad():
        ys = [net(x) for net in nets]
    diffs = [(b - a).abs().max().item() for a, b in itertools.pairwise(ys)]
    # First order in h: each halving of h halves the change.
    assert diffs[0] > 0
    for a, b in itertools.pairwise(diffs):
        assert 0.35 < b / a < 0.65, diffs


def test_refine_refuses_bad_arguments() -> None:
    with pytest.raises(MGRITConfigError, match="factor must be an int >= 1, got 0"):
        refine(coarse_net(), factor=0)
    with pytest.raises(MGRITConfigError, match="unknown settings \\['iters'\\]"):
        refine(coarse_net(), iters=3)
