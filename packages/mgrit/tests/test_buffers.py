"""Buffers allocated once and weights stacked once: reuse must not change a single bit.

The solver keeps its level tensors across solves (per state shape, dtype and
device), the layer-parallel forward hands its fine level to the backward
without a copy (reused once the graph that read it is gone), and stacked
weights are restacked only when a parameter changed (its version counter or
its tensor). Each test checks the reuse happens and that the results equal a
fresh object's, bit for bit, on any rank count.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpx.mgrit import MGRIT, LayerParallel
from mpx.mgrit.adjoint import StackedSteps, TimeStepper

pytestmark = pytest.mark.mpi


def decay(u: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
    out: torch.Tensor = u / (1 + dt.view(-1, *[1] * (u.dim() - 1)))
    return out


def _pointers(solver: MGRIT) -> list[int]:
    tensors = [*solver._u, *solver._g, *solver._v, *solver._scratch]
    return [t.data_ptr() for t in tensors if t is not None]


@pytest.mark.parametrize("nested", [True, False])
def test_level_tensors_are_allocated_once_and_reused_exactly(nested: bool) -> None:
    def make() -> MGRIT:
        return MGRIT(decay, 0.0, 4.0, 64, levels=3, cfactor=4, max_iters=2, tol=0.0,
                     vectorized=True, skip_downcycle=nested)  # fmt: skip

    solver = make()
    u0 = torch.linspace(1.0, 2.0, 6, dtype=torch.float64)
    first = solver.solve(u0)
    kept = _pointers(solver)
    history = list(solver.residuals)
    # A different start value: stale rows of the last solve must not leak into this one.
    other = solver.solve(2 * u0 + 1)
    assert _pointers(solver) == kept  # the same tensors, written again
    fresh = make()
    torch.testing.assert_close(other, fresh.solve(2 * u0 + 1), rtol=0, atol=0)
    assert solver.residuals == fresh.residuals
    again = solver.solve(u0)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    assert solver.residuals == history
    # Another dtype is another set of level tensors.
    as32 = solver.solve(u0.float())
    assert as32.dtype == torch.float32
    torch.testing.assert_close(as32, make().solve(u0.float()), rtol=0, atol=0)


def _net(batched: bool = True) -> LayerParallel:
    torch.manual_seed(0)
    return LayerParallel(
        nn.Linear(4, 6), lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3),
        num_steps=32, Tf=2.0, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, tol=0.0,
        batched=batched,
    ).double()  # fmt: skip


def _input(seed: int) -> torch.Tensor:
    return torch.randn(5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _grads(net: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in net.parameters() if p.grad is not None]


def _recording(stepper: TimeStepper) -> list[int]:
    """The data pointers of the states each forward hands to the backward; each must be
    the fine level the forward solve wrote (no copy)."""
    seen: list[int] = []
    forward, solve = stepper.forward, stepper.fwd.solve
    solved: list[int] = []

    def record_solve(u0: torch.Tensor) -> torch.Tensor:
        out = solve(u0)
        solved.append(stepper.fwd._u[0].data_ptr())
        return out

    def record(x0: torch.Tensor) -> Any:
        out = forward(x0)
        seen.append(out[1].data_ptr())
        assert seen[-1] == solved[-1], "the states are the solver's fine level, not a copy"
        return out

    stepper.forward = record  # type: ignore[method-assign]
    stepper.fwd.solve = record_solve  # type: ignore[method-assign]
    return seen


def test_forward_states_are_reused_once_their_graph_is_gone() -> None:
    net = _net()
    seen = _recording(net.stepper)
    for seed in range(3):  # training steps whose graphs are freed by their backward
        net.zero_grad()
        net(_input(seed)).square().sum().backward()
    if net.owned_steps():
        assert len(set(seen)) == 1, seen  # one tensor, written by every forward
    # Two graphs alive at once: the second forward must not write the first's states.
    net.zero_grad()
    y1 = net(_input(7))
    y2 = net(_input(8))
    if net.owned_steps():
        assert seen[-1] != seen[-2]
    y1.square().sum().backward()
    grads = _grads(net)
    ref = _net()
    ref(_input(7)).square().sum().backward()
    for a, b in zip(grads, _grads(ref), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    del y2


def _first_linear(net: LayerParallel) -> nn.Linear:
    layer = net.local_steps[0]
    assert isinstance(layer, nn.Sequential)
    linear = layer[0]
    assert isinstance(linear, nn.Linear)
    return linear


def test_weights_are_stacked_once_per_optimizer_step() -> None:
    fast, slow = _net(), _net(batched=False)
    stacked = fast.stepper.stacked
    assert isinstance(stacked, StackedSteps) or not fast.owned_steps()
    assert stacked is None or isinstance(stacked, StackedSteps)
    opts = [torch.optim.SGD(net.parameters(), lr=0.05) for net in (fast, slow)]
    for step in range(3):
        outs = []
        for net, opt in zip((fast, slow), opts, strict=True):
            opt.zero_grad()
            y = net(_input(step))
            y.square().sum().backward()
            outs.append((y.detach(), _grads(net)))
            opt.step()
        # The stacked weights follow the optimizer: the same training as one call a step.
        torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-13)
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
        if stacked is not None:
            assert stacked.stacks == step + 1  # forward and backward: one stacking
    if stacked is None:
        return
    with torch.no_grad():
        fast(_input(0))  # after the last optimizer step: stacked once more ...
        fast(_input(1))  # ... and no weight changed since: nothing restacked
    assert stacked.stacks == 4
    layer, twin = _first_linear(fast), _first_linear(slow)
    with torch.no_grad():
        layer.weight.mul_(0.5)  # changed in place: its version counter moves
        twin.weight.mul_(0.5)
        y_fast, y_slow = fast(_input(1)), slow(_input(1))
    assert stacked.stacks == 5
    torch.testing.assert_close(y_fast, y_slow, rtol=0, atol=1e-13)
    layer.bias.data = layer.bias.data + 1.0  # another tensor (same version count)
    twin.bias.data = twin.bias.data + 1.0
    with torch.no_grad():
        y_fast, y_slow = fast(_input(1)), slow(_input(1))
    assert stacked.stacks == 6
    torch.testing.assert_close(y_fast, y_slow, rtol=0, atol=1e-13)
