"""Weight prediction against the optimizers themselves, run ``d`` steps ahead."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch

from mpx.pipeline import PipelineError
from mpx.pipeline.staleness.prediction import future_lrs, predict

TOL = 1e-12


def warmed(
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer], steps: int = 3
) -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
    """A parameter and its optimizer after a few steps on random gradients."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, dtype=torch.float64))
    opt = make([p])
    for _ in range(steps):
        p.grad = torch.randn_like(p)
        opt.step()
    p.grad = None
    return p, opt


def run_ahead(
    p: torch.nn.Parameter,
    opt: torch.optim.Optimizer,
    d: int,
    first_grad: torch.Tensor | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
) -> torch.Tensor:
    """Runs copies of the optimizer (and scheduler) ``d`` steps: first_grad, then zeros."""
    # One deepcopy of both keeps the scheduler attached to the twin optimizer.
    twin, twin_sched = copy.deepcopy((opt, scheduler))
    twin_p: torch.Tensor = twin.param_groups[0]["params"][0]
    for s in range(d):
        twin_p.grad = (
            first_grad.clone() if (s == 0 and first_grad is not None) else torch.zeros_like(p)
        )
        twin.step()
        if twin_sched is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # deepcopy unwraps optimizer.step
                twin_sched.step()
    return twin_p.detach()


@pytest.mark.parametrize("d", [0, 1, 2, 5])
@pytest.mark.parametrize("nesterov", [False, True])
def test_msnag_sgd_equals_d_steps_with_zero_gradient(d: int, nesterov: bool) -> None:
    p, opt = warmed(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=nesterov))
    got = predict(opt, [p], d, "msnag")[p]
    torch.testing.assert_close(got, run_ahead(p, opt, d), rtol=0, atol=TOL)


def test_msnag_sgd_closed_form() -> None:
    p, opt = warmed(lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8))
    v = opt.state[p]["momentum_buffer"]
    d, g, eta = 4, 0.8, 0.05
    expected = p.detach() - eta * v * (g - g ** (d + 1)) / (1 - g)
    torch.testing.assert_close(predict(opt, [p], d, "msnag")[p], expected, rtol=0, atol=TOL)


@pytest.mark.parametrize("d", [1, 3])
@pytest.mark.parametrize("partial", [False, True])
def test_aggmsnag_sgd_weight_decay_equals_the_optimizer(d: int, partial: bool) -> None:
    p, opt = warmed(
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.05, dampening=0.1)
    )
    grad = torch.randn_like(p) if partial else None
    p.grad = grad
    got = predict(opt, [p], d, "aggmsnag")[p]
    torch.testing.assert_close(got, run_ahead(p, opt, d, grad), rtol=0, atol=TOL)
    # msnag ignores the weight decay, so it differs here (the check can fail).
    assert not torch.allclose(predict(opt, [p], d, "msnag")[p], got, rtol=0, atol=1e-6)


@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("d", [1, 3])
def test_aggmsnag_adam_equals_the_optimizer(cls: type, d: int) -> None:
    p, opt = warmed(lambda ps: cls(ps, lr=0.01, weight_decay=0.1))
    grad = torch.randn_like(p)
    p.grad = grad
    got = predict(opt, [p], d, "aggmsnag")[p]
    torch.testing.assert_close(got, run_ahead(p, opt, d, grad), rtol=0, atol=TOL)


def test_msnag_adam_is_the_stated_formula() -> None:
    p, opt = warmed(lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-6))
    m, v, t = opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"], 3
    theta = p.detach().clone()
    for s in (1, 2):
        b1, b2 = 0.8, 0.99
        theta = theta - 0.01 / (1 - b1 ** (t + s)) * b1**s * m / (
            v.sqrt() / (1 - b2 ** (t + s)) ** 0.5 + 1e-6
        )
    torch.testing.assert_close(predict(opt, [p], 2, "msnag")[p], theta, rtol=0, atol=TOL)
    # With one step ahead the first moment part is Adam's zero-gradient step exactly
    # up to the second moment's decay, which msnag leaves out.
    one = predict(opt, [p], 1, "msnag")[p]
    assert not torch.equal(one, p.detach())


def test_scheduler_aware_prediction() -> None:
    p, opt = warmed(lambda ps: torch.optim.SGD(ps, lr=0.4, momentum=0.9))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    lrs = future_lrs(opt, sched, 3)
    assert lrs == [[0.4], [0.2], [0.1]]
    assert opt.param_groups[0]["lr"] == 0.4  # the real scheduler did not move
    assert sched.last_epoch == 0
    got = predict(opt, [p], 3, "msnag", lrs)[p]
    torch.testing.assert_close(got, run_ahead(p, opt, 3, scheduler=sched), rtol=0, atol=TOL)
    constant = predict(opt, [p], 3, "msnag")[p]
    assert not torch.allclose(constant, got, rtol=0, atol=1e-6)


def test_unsupported_optimizer_and_mode() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    with pytest.raises(PipelineError, match="RMSprop"):
        predict(torch.optim.RMSprop([p]), [p], 1, "msnag")
    with pytest.raises(PipelineError, match="nag"):
        predict(torch.optim.SGD([p], lr=0.1), [p], 1, "nag")
