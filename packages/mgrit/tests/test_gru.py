"""ParallelGRU against the serial loop of torch's GRUCell (float64), on any rank count."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.mgrit import MGRITConfigError, ParallelGRU
from mpx.mgrit.gru import gru_step

pytestmark = pytest.mark.mpi

T = 24


def serial_loop(cell: nn.GRUCell, x: torch.Tensor) -> torch.Tensor:
    h = x.new_zeros((x.shape[0], cell.hidden_size))
    for k in range(x.shape[1]):
        h = cell(x[:, k], h)
    return h


def run(gru: ParallelGRU) -> dict[str, float]:
    """Max abs differences of h_T and of every gradient vs the serial loop."""
    ref = nn.GRUCell(3, 5).double()
    ref.load_state_dict(gru.cell.state_dict())
    x = torch.randn(4, T, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hp, hs = gru(xp), serial_loop(ref, xs)
    hp.square().sum().backward()
    hs.square().sum().backward()
    assert xp.grad is not None
    assert xs.grad is not None
    errs = {"h": (hp - hs).abs().max().item(), "x_grad": (xp.grad - xs.grad).abs().max().item()}
    for (name, p), q in zip(gru.cell.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        errs[name] = (p.grad - q.grad).abs().max().item()
    return errs


@pytest.mark.parametrize(("levels", "iters"), [(1, 1), (2, T // 2), (3, T // 2)])
def test_exact_solve_equals_serial_gru_loop(levels: int, iters: int) -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, T, levels=levels, cfactor=2, fwd_iters=iters, bwd_iters=iters, tol=0.0)
    errs = run(gru.double())
    assert max(errs.values()) <= 1e-12, errs


def test_few_iterations_are_close_and_gradients_agree_across_ranks() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, T, levels=2, cfactor=4, fwd_iters=3, bwd_iters=3, tol=0.0).double()
    errs = run(gru)
    assert max(errs.values()) <= 1e-2, errs
    res = gru.fwd_stats()["residuals"]
    assert isinstance(res, list)
    assert res[-1] < res[0]
    grads = [p.grad for p in gru.cell.parameters()]
    for other in world().mpi.allgather(grads):
        for a, b in zip(grads, other, strict=True):
            assert a is not None
            assert b is not None
            assert torch.equal(a, b)


def test_coarse_step_is_stable_and_fine_step_is_the_cell() -> None:
    cell = nn.GRUCell(2, 3).double()
    x, h = torch.randn(1, 2, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64)
    assert torch.equal(gru_step(cell, x, h, 1.0), cell(x, h))
    big = gru_step(cell, x, 10 * h, 64.0)
    assert big.abs().max() <= 10 * h.abs().max()


def test_wrong_sequence_length_is_refused() -> None:
    gru = ParallelGRU(3, 5, T, levels=1)
    with pytest.raises(MGRITConfigError, match="seq_len=24"):
        gru(torch.zeros(2, T + 1, 3))


def test_two_sequences_before_one_backward() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, T, levels=1).double()
    ref = nn.GRUCell(3, 5).double()
    ref.load_state_dict(gru.cell.state_dict())
    gen = torch.Generator().manual_seed(6)
    xs = [torch.randn(2, T, 3, dtype=torch.float64, generator=gen) for _ in range(2)]
    xa = [x.clone().requires_grad_(True) for x in xs]
    xb = [x.clone().requires_grad_(True) for x in xs]
    torch.autograd.backward(gru(xa[0]).square().sum() + gru(xa[1]).sum())
    torch.autograd.backward(serial_loop(ref, xb[0]).square().sum() + serial_loop(ref, xb[1]).sum())
    for a, b in zip(xa, xb, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    for p, q in zip(gru.cell.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
