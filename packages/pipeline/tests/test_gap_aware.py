"""Gap-aware penalties against hand computation."""

from __future__ import annotations

import math

import torch

from mpx.pipeline.staleness.gap_aware import GapAware


def test_sgd_penalty_by_hand() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    ga = GapAware(opt)
    used = torch.tensor([0.5, 2.0], dtype=torch.float64)
    assert ga.penalty(p, used) == 1.0  # no statistics before the first step
    p.grad = torch.tensor([2.0, -4.0], dtype=torch.float64)
    opt.step()  # momentum buffer = grad on the first step: [2, -4]; p = [0, 4]
    ga.after_step(opt, None)
    # A = 0.001 * u^2 = [0.004, 0.016]; bias-corrected: A / (1 - 0.999) = [4, 16]
    c = [0.5 * (math.sqrt(4.0) + 1e-8), 0.5 * (math.sqrt(16.0) + 1e-8)]
    phi = ga.penalty(p, used)
    assert isinstance(phi, torch.Tensor)  # per element, now that there are statistics
    expected = torch.tensor(
        [1 + abs(0.0 - 0.5) / c[0], 1 + abs(4.0 - 2.0) / c[1]], dtype=torch.float64
    )
    torch.testing.assert_close(phi, expected, rtol=0, atol=1e-12)
    assert not torch.allclose(phi, torch.ones(2, dtype=torch.float64))


def test_second_step_running_mean_and_weight_decay() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0], dtype=torch.float64))
    opt = torch.optim.SGD([p], lr=0.1, weight_decay=0.5)  # no momentum: u = gradient
    ga = GapAware(opt)
    for g in (3.0, 1.0):
        p.grad = torch.tensor([g], dtype=torch.float64)
        opt.step()
        ga.after_step(opt, None)
    a = 0.999 * (0.001 * 9.0) + 0.001 * 1.0
    c = 0.1 * (math.sqrt(a / (1 - 0.999**2)) + 1e-8)
    theta = p.item()
    phi = ga.penalty(p, torch.tensor([theta - 0.3], dtype=torch.float64))
    assert abs(float(phi) - (1 + 0.3 / c)) < 1e-12
    # Weight decay damped too: the step's gradient becomes (g + λθ)/Φ.
    p.grad = torch.tensor([2.0], dtype=torch.float64) / phi
    ga.damp_weight_decay(opt)
    total = float(p.grad) + 0.5 * theta
    assert abs(total - (2.0 + 0.5 * theta) / float(phi)) < 1e-12


def test_adam_scale_is_the_rms_of_applied_steps() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -1.0], dtype=torch.float64))
    opt = torch.optim.Adam([p], lr=0.01)
    ga = GapAware(opt)
    before: dict[torch.Tensor, torch.Tensor] = {p: p.detach().clone()}
    p.grad = torch.tensor([1.0, 2.0], dtype=torch.float64)
    opt.step()
    ga.after_step(opt, before)
    step = before[p] - p.detach()
    c = ga.scale(p)
    assert c is not None
    torch.testing.assert_close(c, step.abs() + 1e-8, rtol=0, atol=1e-12)
