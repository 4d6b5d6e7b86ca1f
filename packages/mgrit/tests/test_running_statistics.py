"""BatchNorm in LayerParallel's step layers: running statistics as the serial network's.

MGRIT calls a step layer many times per forward pass (relaxations, coarse levels
with longer steps, the adjoint): left alone, a BatchNorm would fold every call into
its running mean and variance. These tests train the layer-parallel network and its
own serial network (plain autograd, the same weights) side by side, on any rank count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mpx.mgrit import LayerParallel, SerialResNet

pytestmark = pytest.mark.mpi

WIDTH = 5
#: Converged solves (2 levels, as many iterations as steps): both networks agree to rounding.
EXACT: dict[str, Any] = {"levels": 2, "cfactor": 2, "fwd_iters": 8, "bwd_iters": 8, "tol": 0.0}


def dense_step() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Tanh())


def conv_step() -> nn.Module:
    # torchbraid's step layer: convolution, BatchNorm2d, ReLU.
    return nn.Sequential(nn.Conv2d(2, 2, 3, padding=1), nn.BatchNorm2d(2), nn.ReLU())


def build(
    step: Callable[[], nn.Module] = dense_step, num_steps: int = 8, **settings: Any
) -> tuple[LayerParallel, SerialResNet]:
    torch.manual_seed(0)  # every rank builds the same layers
    open_layer, close_layer = nn.Linear(3, WIDTH), nn.Linear(WIDTH, 2)
    net = LayerParallel(open_layer, step, close_layer, num_steps, Tf=2.0, **(EXACT | settings))
    net = net.double()
    return net, net.serial()


def batch(seed: int, shape: tuple[int, ...] = (6, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 2, (shape[0],), generator=gen)


def train(model: nn.Module, steps: int, shape: tuple[int, ...] = (6, 3)) -> None:
    """``steps`` SGD steps of cross-entropy, each on its own batch."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for i in range(steps):
        x, y = batch(10 + i, shape)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def assert_states_equal(net: LayerParallel, serial: SerialResNet, atol: float) -> None:
    """Parameters and buffers (running statistics) of ``net`` and ``serial`` agree."""
    got = net.serial().state_dict()
    want = serial.state_dict()
    assert got.keys() == want.keys()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=atol, msg=name)


def running_means(model: LayerParallel | SerialResNet) -> list[torch.Tensor]:
    whole = model.serial() if isinstance(model, LayerParallel) else model
    return [b for n, b in whole.named_buffers() if n.endswith("running_mean")]


def test_training_steps_leave_the_serial_networks_weights_and_running_statistics() -> None:
    net, serial = build()
    before = running_means(net)
    train(net, 3)
    train(serial, 3)
    assert_states_equal(net, serial, atol=1e-12)
    # The statistics moved: not a comparison of untouched buffers.
    assert all(not torch.equal(a, b) for a, b in zip(before, running_means(net), strict=True))
    for name, count in net.serial().state_dict().items():
        if name.endswith("num_batches_tracked"):
            assert int(count) == 3, name  # one update per forward pass, not one per call


def test_eval_mode_normalizes_with_the_running_statistics() -> None:
    net, serial = build()
    train(net, 2)
    train(serial, 2)
    x, _ = batch(99)
    training_output = net(x).detach()
    serial(x)  # a training forward pass updates the statistics of both
    net.eval()
    serial.eval()
    with torch.no_grad():
        got, want = net(x), serial(x)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert (got - training_output).abs().max() > 1e-3  # batch statistics differ from them
    assert_states_equal(net, serial, atol=1e-12)  # eval passes update nothing


def test_gradients_through_batch_statistics_equal_autograds() -> None:
    net, serial = build()
    x, y = batch(5)
    nn.functional.cross_entropy(net(x), y).backward()
    nn.functional.cross_entropy(serial(x), y).backward()
    ref = dict(serial.named_parameters())
    for name, p in net.named_parameters():
        serial_name = name
        if name.startswith("local_steps."):
            _, k, rest = name.split(".", 2)
            serial_name = f"steps.{int(k) + net.first_step}.{rest}"
        q = ref[serial_name]
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


def test_convolutional_steps_with_batchnorm2d() -> None:
    torch.manual_seed(0)
    net = LayerParallel(
        nn.Conv2d(1, 2, 3, padding=1), conv_step, nn.Sequential(nn.Flatten(), nn.Linear(32, 2)),
        4, Tf=1.0, levels=2, cfactor=2, fwd_iters=4, bwd_iters=4, tol=0.0,
    ).double()  # fmt: skip
    serial = net.serial()
    train(net, 2, shape=(6, 1, 4, 4))
    train(serial, 2, shape=(6, 1, 4, 4))
    assert_states_equal(net, serial, atol=1e-12)


def test_an_inexact_solve_updates_from_its_own_states_once() -> None:
    # One V-cycle of three levels: the solved states are not the serial ones, so neither
    # are the statistics; they are still updated once, and differ from the serial ones
    # by about the solve's error, not by the many calls of the solve.
    net, serial = build(levels=3, fwd_iters=1, bwd_iters=1)
    exact, _ = build()
    for model in (net, serial, exact):
        train(model, 1)
    pairs = zip(running_means(net), running_means(serial), strict=True)
    gap = max((a - b).abs().max().item() for a, b in pairs)
    assert 0.0 < gap < 0.05, gap
    assert_states_equal(exact, serial, atol=1e-12)
    counts = [int(b) for n, b in net.serial().named_buffers() if n.endswith("batches_tracked")]
    assert counts == [1] * 8


def test_a_step_layer_in_eval_mode_keeps_its_statistics_while_the_network_trains() -> None:
    net, serial = build()
    for model in (net, serial):
        for layer in model.local_steps if isinstance(model, LayerParallel) else model.steps:
            layer.eval()
    before = net.serial().state_dict()
    train(net, 1)
    train(serial, 1)
    assert_states_equal(net, serial, atol=1e-12)
    after = net.serial().state_dict()
    for name in before:
        if "running" in name or "batches_tracked" in name:
            assert torch.equal(before[name], after[name]), name


def test_momentum_none_cumulative_average_and_instance_norm() -> None:
    # momentum=None averages every update alike (1/n): a second update per forward pass
    # would show at once. InstanceNorm with running statistics is held the same way.
    def step() -> nn.Module:
        return nn.Sequential(
            nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH, momentum=None), nn.Tanh(),
            nn.Unflatten(1, (1, WIDTH)), nn.InstanceNorm1d(1, track_running_stats=True),
            nn.Flatten(),
        )  # fmt: skip

    net, serial = build(step)
    train(net, 2)
    train(serial, 2)
    assert_states_equal(net, serial, atol=1e-12)
