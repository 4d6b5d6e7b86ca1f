"""ParallelGRU's batched steps (mpx.mgrit.adjoint.gru_steps) against one cell call per step.

Batching changes how each step runs, not what MGRIT computes: on inexact solves
(few iterations, where every step of the algorithm shows in the result) the
batched and the unbatched module must agree to rounding, in the output, h_n and
every gradient, with padding, both directions and several layers, on any rank
count. The backward linearises each step once per step size it uses instead of
replaying a forward before every vector-Jacobian product, which the work count
shows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from mpx.mgrit import ParallelGRU, work

pytestmark = pytest.mark.mpi


def tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _run(gru: ParallelGRU, x: torch.Tensor, hx: torch.Tensor) -> list[torch.Tensor]:
    gru.zero_grad()
    xp, hp = x.clone().requires_grad_(True), hx.clone().requires_grad_(True)
    out, h_n = gru(xp, hp)
    ((out * tensor(*out.shape, seed=9)).sum() + h_n.square().sum()).backward()
    assert xp.grad is not None
    assert hp.grad is not None
    grads = [p.grad for p in gru.parameters()]
    assert all(g is not None for g in grads)
    return [out.detach(), h_n.detach(), xp.grad, hp.grad, *(g for g in grads if g is not None)]


@pytest.mark.parametrize(
    ("seq_len", "layers", "bidirectional", "settings"),
    [
        (24, 1, False, {"levels": 2, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 1}),
        (32, 2, False, {"levels": 3, "cfactor": 2, "fwd_iters": 2, "bwd_iters": 1}),
        (21, 2, True, {"levels": 3, "cfactor": 2, "fwd_iters": 1, "bwd_iters": 2}),
        (13, 1, True, {"levels": 2, "cfactor": 4, "relax": "F", "fwd_iters": 1, "bwd_iters": 1}),
        (30, 1, False, {"levels": 2, "cfactor": 3, "relax": "F", "cycle_type": "F"}),
        (18, 2, False, {"fwd_levels": 3, "bwd_levels": 2, "cfactor": 2, "fwd_iters": 1}),
    ],
)
def test_batched_equals_one_cell_call_per_step(
    seq_len: int, layers: int, bidirectional: bool, settings: dict[str, Any]
) -> None:
    runs = []
    for batched in (True, False):
        torch.manual_seed(0)
        gru = ParallelGRU(3, 5, layers, bidirectional=bidirectional, tol=0.0, batched=batched,
                          **settings).double()  # fmt: skip
        hx = tensor(layers * (2 if bidirectional else 1), 4, 5, seed=2)
        runs.append(_run(gru, tensor(seq_len, 4, 3, seed=1), hx))
    # Inexact solves: far from torch.nn.GRU, so every step of the algorithm counts.
    ref = torch.nn.GRU(3, 5, layers, bidirectional=bidirectional).double()
    ref.load_state_dict(gru.state_dict())
    exact = ref(tensor(seq_len, 4, 3, seed=1), hx)[0]
    assert (runs[0][0] - exact).abs().max() > 1e-6
    for a, b in zip(*runs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_batched_backward_linearises_each_step_once_per_step_size() -> None:
    """32 steps, 3 levels, cfactor 2: a rank steps the same rows either way; the batched
    backward linearises, once per step size s in 1, 2, 4, each step it may take at that
    size: the steps g of its block ending on a point of that level ((g + 1) % s == 0),
    and the step before its block (fine split: from its left neighbour's last point);
    unbatched, one per adjoint product."""
    counts = []
    for batched in (True, False):
        torch.manual_seed(0)
        gru = ParallelGRU(3, 5, levels=3, cfactor=2, fwd_iters=2, bwd_iters=2, tol=0.0,
                          batched=batched).double()  # fmt: skip
        gru(tensor(32, 2, 3, seed=1))[0].square().sum().backward()
        counts.append(work(gru))
    fast, slow = counts
    stepper = gru._last_stepper()
    n = len(stepper.owned_steps())
    assert fast["forward"] == slow["forward"] > 0 or n == 0
    assert fast["adjoint"] == slow["adjoint"] == slow["linearize"]
    start = stepper.first - (stepper.fwd.layout.left is not None)
    steps = range(start, stepper.stop) if n > 0 else range(0)
    assert fast["linearize"] == sum((g + 1) % s == 0 for s in (1, 2, 4) for g in steps)
    assert fast["linearize"] < fast["adjoint"] or n == 0
