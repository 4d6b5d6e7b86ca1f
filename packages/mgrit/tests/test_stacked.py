"""Stacked (batched) step layers: the same algorithm as one module call per step.

Batched relaxation and the once-linearised adjoint change how each step runs,
not what MGRIT computes: an inexact solve (one V-cycle each way, where the
result depends on every step of the algorithm) must agree with the unbatched
path to rounding, output and every gradient, on any rank count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mpx.mgrit import LayerParallel
from mpx.mgrit.adjoint import StackedSteps

pytestmark = pytest.mark.mpi


def _pair(make: Callable[[], nn.Module], **kw: Any) -> tuple[LayerParallel, LayerParallel]:
    nets = []
    for batched in (True, False):
        torch.manual_seed(0)
        net = LayerParallel(
            nn.Linear(4, 6), make, nn.Linear(6, 3), num_steps=32, Tf=2.0, batched=batched, **kw
        ).double()
        nets.append(net)
    return nets[0], nets[1]


def _input() -> torch.Tensor:
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def _run(net: LayerParallel) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    x = _input().requires_grad_(True)
    y = net(x)
    y.square().sum().backward()
    assert x.grad is not None
    grads = [p.grad for p in net.parameters()]
    assert all(g is not None for g in grads)
    return y.detach(), x.grad, [g for g in grads if g is not None]


LAYERS: list[Callable[[], nn.Module]] = [
    lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()),
    lambda: nn.Sequential(nn.Linear(6, 6), nn.LeakyReLU(0.1)),
    lambda: nn.Linear(6, 6, bias=False),
]


@pytest.mark.parametrize("make", LAYERS)
@pytest.mark.parametrize(
    "settings",
    [
        {"levels": 3, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 1},
        {"levels": 2, "cfactor": 4, "fwd_iters": 2, "bwd_iters": 1, "relax": "FCF"},
        {"fwd_levels": 3, "bwd_levels": 2, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 2},
    ],
)
def test_batched_equals_one_call_per_step(
    make: Callable[[], nn.Module], settings: dict[str, Any]
) -> None:
    fast, slow = _pair(make, tol=0.0, **settings)
    assert fast.stepper.stacked is not None or not list(fast.owned_steps())
    assert slow.stepper.stacked is None
    (y1, gx1, g1), (y2, gx2, g2) = _run(fast), _run(slow)
    # Both are inexact solves (far from the serial network), so every step counts.
    assert (y1 - fast.serial()(_input()).detach()).abs().max() > 1e-9
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-13)
    torch.testing.assert_close(gx1, gx2, rtol=0, atol=1e-13)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    assert fast.fwd_stats()["residuals"] == pytest.approx(slow.fwd_stats()["residuals"], rel=1e-9)
    assert fast.bwd_stats()["residuals"] == pytest.approx(slow.bwd_stats()["residuals"], rel=1e-9)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = 2 * self.lin(x)
        return out


def test_what_cannot_be_stacked_runs_one_call_per_step() -> None:
    hooked = nn.Linear(3, 3)
    hooked.register_forward_hook(lambda *_: None)
    frozen = nn.Linear(3, 3)
    frozen.bias.requires_grad_(False)
    refused: list[list[nn.Module]] = [
        [_Twice()],  # not a Linear or Sequential(Linear, act)
        [nn.Linear(3, 4)],  # not square
        [nn.Sequential(nn.Linear(3, 3), nn.Softmax(dim=0))],  # not elementwise
        [
            nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.1)),
            nn.Sequential(nn.Linear(3, 3), nn.LeakyReLU(0.2)),
        ],
        [nn.Linear(3, 3), nn.Linear(3, 3, bias=False)],
        [hooked],
        [frozen],
        [],
    ]
    for layers in refused:
        assert StackedSteps.of(layers) is None, layers
    assert StackedSteps.of([nn.Linear(3, 3), nn.Linear(3, 3)]) is not None
    torch.manual_seed(0)
    net = LayerParallel(nn.Identity(), _Twice, nn.Identity(), num_steps=8, levels=2)
    assert net.stepper.stacked is None
