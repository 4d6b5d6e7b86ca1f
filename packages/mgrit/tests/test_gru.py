"""ParallelGRU against torch.nn.GRU with the same weights (float64), on any rank count."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpx.collectives import world
from mpx.mgrit import MGRITConfigError, ParallelGRU
from mpx.mgrit.gru.gru_layer import gru_step

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
                 batch_first=gru.batch_first, bidirectional=gru.bidirectional).double()  # fmt: skip
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
        ({"dropout": 1.5}, ["dropout=1.5", "[0, 1]"]),
        ({"dropout": -0.1}, ["dropout=-0.1", "[0, 1]"]),
        ({"dropout": "0.5"}, ["dropout='0.5'", "[0, 1]"]),
        ({"num_layers": 0}, ["num_layers=0"]),
        ({"fwd_levels": 0}, ["fwd_levels=0"]),
        ({"cycle_type": "W"}, ["cycle_type", "'W'"]),
    ],
)
def test_bad_settings_name_the_value_and_the_fix(kwargs: dict[str, Any], words: list[str]) -> None:
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
    both = ParallelGRU(3, 5, 2, bidirectional=True, levels=1)
    with pytest.raises(MGRITConfigError, match=r"\(2 \* num_layers, batch, hidden_size\) = \(4,"):
        both(torch.zeros(T, 2, 3), torch.zeros(2, 2, 5))
    with pytest.raises(MGRITConfigError, match="0 steps"):
        both(torch.zeros(0, 2, 3))


# -- bidirectional, any length, dropout: nn.GRU's arguments ------------------------


@pytest.mark.parametrize(
    ("num_layers", "batch_first", "bidirectional", "levels", "cfactor", "seq_len"),
    [
        (1, False, True, 1, 2, 7),
        (2, True, True, 2, 2, 23),  # 23 = 2 * 11 + 1: one identity step of padding
        (3, False, True, 3, 2, 14),  # nt=14 was refused: not divisible by 2 * 2
        (2, True, False, 3, 2, 30),  # the nt=30
        (1, False, False, 2, 4, 5),  # padded to 8: a coarse step half in the padding
        (2, False, True, 2, [3], 3),  # one coarsest interval: other ranks hold nothing
        (2, True, True, 2, 2, 1),
    ],
)
def test_bidirectional_and_any_length_equal_torch_gru(
    num_layers: int,
    batch_first: bool,
    bidirectional: bool,
    levels: int,
    cfactor: int | list[int],
    seq_len: int,
) -> None:
    torch.manual_seed(0)
    iters = (seq_len + 1) // 2 + 1  # enough for an exact solve: one per fine C-interval
    gru = ParallelGRU(3, 5, num_layers, batch_first=batch_first, bidirectional=bidirectional,
                      levels=levels, cfactor=cfactor, fwd_iters=iters, bwd_iters=iters,
                      tol=0.0).double()  # fmt: skip
    x = tensor(4, seq_len, 3, seed=1) if batch_first else tensor(seq_len, 4, 3, seed=1)
    hx = tensor(num_layers * (2 if bidirectional else 1), 4, 5, seed=2)
    errs = compare(gru, x, hx)
    assert max(errs.values()) <= 1e-12, errs
    if bidirectional:
        assert any(name.endswith("_reverse") for name in errs)


def test_padding_is_the_next_multiple_of_the_coarsest_interval() -> None:
    gru = ParallelGRU(3, 5, levels=3, cfactor=2)
    assert [gru.padded_length(n) for n in (1, 4, 29, 30, 32)] == [4, 4, 32, 32, 32]
    both = ParallelGRU(3, 5, cfactor=[2, 3], fwd_levels=2, bwd_levels=3)
    assert both.padded_length(7) == 12  # whole coarsest intervals of both grids: lcm(2, 6)


def test_bidirectional_ragged_error_falls_as_iterations_grow() -> None:
    # 18 steps padded to 20, 3 levels: every added iteration brings output, h_n and every
    # gradient closer to nn.GRU, down to rounding.
    worst, output = [], []
    for iters in (1, 2, 3, 4, 10):
        torch.manual_seed(0)
        gru = ParallelGRU(3, 5, 2, bidirectional=True, levels=3, fwd_iters=iters,
                          bwd_iters=iters, tol=0.0).double()  # fmt: skip
        errs = compare(gru, tensor(18, 4, 3, seed=1), None)
        worst.append(max(errs.values()))
        output.append(errs["output"])
    assert all(b < a for a, b in itertools.pairwise(worst)), worst
    assert all(b < a for a, b in itertools.pairwise(output)), output
    assert worst[3] > 1e-6  # four iterations: really inexact
    assert worst[-1] <= 1e-12
    grads = [p.grad for p in gru.parameters()]
    for other in world().mpi.allgather(grads):
        for a, b in zip(grads, other, strict=True):
            assert a is not None
            assert b is not None
            assert torch.equal(a, b)


def test_tolerance_stops_the_solves_close_to_torch_gru() -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, 2, bidirectional=True, batch_first=True, levels=3, fwd_iters=40,
                      bwd_iters=40, tol=1e-10).double()  # fmt: skip
    errs = compare(gru, tensor(4, 21, 3, seed=1), tensor(4, 4, 5, seed=2))
    fwd, bwd = gru.fwd_stats(), gru.bwd_stats()
    assert isinstance(fwd["iterations"], int)
    assert isinstance(bwd["iterations"], int)
    assert fwd["iterations"] < 40  # stopped by the tolerance, not by the iterations
    assert bwd["iterations"] < 40
    assert max(errs.values()) <= 1e-8, errs


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("p", [0.3, 1.0])
def test_dropout_between_layers_is_torch_grus_under_the_same_seed(
    bidirectional: bool, p: float
) -> None:
    torch.manual_seed(0)
    gru = ParallelGRU(3, 5, 3, dropout=p, bidirectional=bidirectional, levels=2, fwd_iters=8,
                      bwd_iters=8, tol=0.0).double()  # fmt: skip
    ref = nn.GRU(3, 5, 3, dropout=p, bidirectional=bidirectional).double()
    ref.load_state_dict(gru.state_dict())
    x = tensor(13, 4, 3, seed=1)
    runs = []
    for module in (gru, ref):
        xi = x.clone().requires_grad_(True)
        torch.manual_seed(7)  # the same masks on every rank and for both modules
        out, h_n = module(xi)
        (out.square().sum() + h_n.sum()).backward()
        assert xi.grad is not None
        runs.append([out, h_n, xi.grad, *(q.grad for q in module.parameters())])
    for a, b in zip(*runs, strict=True):
        assert a is not None
        assert b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    # The masks did act (this is not the dropout-free network) ...
    torch.manual_seed(7)
    plain = nn.GRU(3, 5, 3, bidirectional=bidirectional).double()
    plain.load_state_dict(gru.state_dict())
    assert (plain(x)[0] - runs[0][0]).abs().max() > 1e-3
    # ... and only in training mode.
    gru.eval()
    torch.testing.assert_close(gru(x)[0], plain(x)[0], rtol=0, atol=1e-12)


def test_dropout_with_one_layer_warns_as_torch_gru_does() -> None:
    with pytest.warns(UserWarning, match="num_layers=1"):
        ParallelGRU(3, 5, 1, dropout=0.2)


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
