"""ParallelGRU against torch.nn.GRU with the same weights (float64), on any rank count."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpx.collectives import world
from mpx.mgrit import MGRITConfigError, ParallelGRU
from mpx.mgrit.gru import gru_step

pytestmark = pytest.mark.mpi

T = 24


def tensor(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def compare(gru: ParallelGRU, x: torch.Tensor, hx: torch.Tensor | None) -> dict[str, float]:
    """Max abs differences of output, h_n and every gradient vs torch.nn.GRU (same weights).

    The loss reads every output step (weighted) and h_n, so the adjoint has a source at
    every step and at the end of every layer.
    """
    ref = nn.GRU(gru.input_size, gru.hidden_size, gru.num_layers, bias=gru.bias,
                 batch_first=gru.batch_first).double()  # fmt: skip
    ref.load_state_dict(gru.state_dict())
    gru.zero_grad()
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    hp = None if hx is None else hx.clone().requires_grad_(True)
    hs = None if hx is None else hx.clone().requires_grad_(True)
    out_p, hn_p = gru(xp, hp)
    out_s, hn_s = ref(xs, hs)
    assert out_p.shape == out_s.shape
    assert hn_p.shape == hn_s.shape
    weight = tensor(*out_s.shape, seed=9)
    ((out_p * weight).sum() + hn_p.square().sum()).backward()
    ((out_s * weight).sum() + hn_s.square().sum()).backward()
    assert xp.grad is not None
    assert xs.grad is not None
    errs = {
        "output": (out_p - out_s).abs().max().item(),
        "h_n": (hn_p - hn_s).abs().max().item(),
        "input_grad": (xp.grad - xs.grad).abs().max().item(),
    }
    if hp is not None and hs is not None:
        assert hp.grad is not None
        assert hs.grad is not None
        errs["hx_grad"] = (hp.grad - hs.grad).abs().max().item()
    mine = dict(gru.named_parameters())
    for name, q in ref.named_parameters():
        p = mine[name]
        assert p.grad is not None
        assert q.grad is not None
        errs[name] = (p.grad - q.grad).abs().max().item()
    return errs


@pytest.mark.parametrize(
    ("num_layers", "batch_first", "bias", "levels", "iters"),
    [
        (1, False, True, 1, 1),
        (2, True, True, 1, 1),
        (1, True, True, 2, T // 2),
        (2, False, False, 3, T // 2),
        (3, True, True, 2, T // 2),
    ],
)
def test_equals_torch_gru_with_the_same_weights(
    num_layers: int, batch_first: bool, bias: bool, levels: int, iters: int
) -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, num_layers, bias=bias, batch_first=batch_first, levels=levels,
                      fwd_iters=iters, bwd_iters=iters, tol=0.0).double()  # fmt: skip
    x = tensor(4, T, 3, seed=1) if batch_first else tensor(T, 4, 3, seed=1)
    errs = compare(gru, x, tensor(num_layers, 4, 5, seed=2))
    assert max(errs.values()) <= 1e-12, errs


def test_unbatched_input_and_no_initial_state() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, 2, levels=2, fwd_iters=T // 2, bwd_iters=T // 2, tol=0.0).double()
    errs = compare(gru, tensor(T, 3, seed=1), None)
    assert max(errs.values()) <= 1e-12, errs
    errs = compare(gru, tensor(T, 3, seed=1), tensor(2, 5, seed=2))
    assert max(errs.values()) <= 1e-12, errs


def test_a_raw_mpi4py_communicator_is_accepted() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, 2, comm=MPI.COMM_WORLD, fwd_iters=T // 2, bwd_iters=T // 2,
                      tol=0.0).double()  # fmt: skip
    assert gru.comm.size == MPI.COMM_WORLD.Get_size()
    errs = compare(gru, tensor(T, 2, 3, seed=1), tensor(2, 2, 5, seed=2))
    assert max(errs.values()) <= 1e-12, errs


def test_more_ranks_than_coarse_intervals() -> None:
    # 4 steps, 2 levels: 2 coarsest intervals; under 3 ranks one rank holds no step.
    torch.manual_seed(0)
    gru = ParallelGRU(2, 3, 2, levels=2, fwd_iters=4, bwd_iters=4, tol=0.0).double()
    errs = compare(gru, tensor(4, 2, 2, seed=1), tensor(2, 2, 3, seed=2))
    assert max(errs.values()) <= 1e-12, errs


def test_same_seed_same_weights_as_torch_gru_and_state_dicts_load_both_ways() -> None:
    torch.manual_seed(5)
    gru = ParallelGRU(3, 4, 2, batch_first=True)
    torch.manual_seed(5)
    ref = nn.GRU(3, 4, 2, batch_first=True)
    assert list(gru.state_dict()) == list(ref.state_dict())
    for a, b in zip(gru.state_dict().values(), ref.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    other = nn.GRU(3, 4, 2, batch_first=True)
    other.load_state_dict(gru.state_dict())
    gru.load_state_dict(nn.GRU(3, 4, 2).state_dict())


def test_inexact_solves_improve_with_iterations_and_agree_across_ranks() -> None:
    worst = []
    for iters in (1, 2, 4):
        torch.manual_seed(0)
        gru = ParallelGRU(3, 5, 2, batch_first=True, levels=2, fwd_iters=iters,
                          bwd_iters=iters, tol=0.0).double()  # fmt: skip
        worst.append(max(compare(gru, tensor(4, T, 3, seed=1), None).values()))
    assert worst[0] > worst[1] > worst[2], worst
    assert worst[2] > 1e-9  # four iterations over 12 coarse intervals: still inexact
    res = gru.fwd_stats()["residuals"]
    assert isinstance(res, list)
    assert res[-1] < res[0]
    grads = [p.grad for p in gru.parameters()]
    for other in world().mpi.allgather(grads):
        for a, b in zip(grads, other, strict=True):
            assert a is not None
            assert b is not None
            assert torch.equal(a, b)


def test_forward_and_adjoint_settings_apply() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, fwd_levels=2, bwd_levels=1, fwd_iters=2, tol=0.0).double()
    compare(gru, tensor(T, 2, 3, seed=1), None)
    assert gru.bwd_stats()["residuals"] == [0.0]
    assert gru.fwd_stats()["iterations"] == 2


def test_coarse_step_is_stable_and_fine_step_is_the_cell() -> None:
    cell = nn.GRUCell(2, 3).double()
    x, h = tensor(1, 2, seed=1), tensor(1, 3, seed=2)
    torch.testing.assert_close(gru_step(cell, x, h, 1.0), cell(x, h), rtol=0, atol=1e-15)
    big = gru_step(cell, x, 10 * h, 64.0)
    assert big.abs().max() <= 10 * h.abs().max()


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"dropout": 0.5}, ["dropout=0.5", "nn.Dropout"]),
        ({"bidirectional": True}, ["bidirectional=True", "flip"]),
        ({"num_layers": 0}, ["num_layers=0"]),
        ({"fwd_levels": 0}, ["fwd_levels=0"]),
    ],
)
def test_unsupported_settings_name_the_value_and_the_fix(
    kwargs: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(MGRITConfigError) as info:
        ParallelGRU(3, 5, seq_len=T, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_wrong_inputs_are_refused() -> None:
    gru = ParallelGRU(3, 5, 2, batch_first=True, seq_len=T, levels=1)
    with pytest.raises(MGRITConfigError, match="seq_len=24"):
        gru(torch.zeros(2, T + 1, 3))
    with pytest.raises(MGRITConfigError, match=r"\(num_layers, batch, hidden_size\)"):
        gru(torch.zeros(2, T, 3), torch.zeros(1, 2, 5))
    with pytest.raises(MGRITConfigError, match="input_size=3"):
        gru(torch.zeros(2, T, 4))
    free = ParallelGRU(3, 5, levels=3, cfactor=2)
    with pytest.raises(MGRITConfigError, match="sequence length 10: nt=10"):
        free(torch.zeros(10, 1, 3))


def test_two_sequences_before_one_backward() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, 2, batch_first=True, levels=2, fwd_iters=T, bwd_iters=T,
                      tol=0.0).double()  # fmt: skip
    ref = nn.GRU(3, 5, 2, batch_first=True).double()
    ref.load_state_dict(gru.state_dict())
    xs = [tensor(2, T, 3, seed=6), tensor(2, T // 2, 3, seed=7)]  # two lengths: two grids
    xa = [x.clone().requires_grad_(True) for x in xs]
    xb = [x.clone().requires_grad_(True) for x in xs]
    torch.autograd.backward(gru(xa[0])[0].square().sum() + gru(xa[1])[1].sum())
    torch.autograd.backward(ref(xb[0])[0].square().sum() + ref(xb[1])[1].sum())
    for a, b in zip(xa, xb, strict=True):
        assert a.grad is not None
        assert b.grad is not None
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    for p, q in zip(gru.parameters(), ref.parameters(), strict=True):
        assert p.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
