"""``impl="cgx"``: the quantized allreduce through mpx-collectives' registry (entry point).

The reference is mpx-quantize's own ``allreduce`` on the same inputs with the
same settings (nearest rounding: deterministic), which test_allreduce.py holds
against a one-process simulation with the pure-torch quantizer. Run under
mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import mpx.quantize as mq
from mpx.collectives import all_implementations, allreduce, broadcast, world
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi


@pytest.fixture
def nearest_4_bits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("MPX_QUANTIZE_BITS", "4")
    monkeypatch.setenv("MPX_QUANTIZE_STOCHASTIC", "0")
    reload_settings()
    yield
    monkeypatch.delenv("MPX_QUANTIZE_BITS")
    monkeypatch.delenv("MPX_QUANTIZE_STOCHASTIC")
    reload_settings()


def _mine(n: int) -> torch.Tensor:
    rank = world().rank
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank)) * (rank + 1)


def test_the_entry_point_registers_cgx() -> None:
    cgx = all_implementations()["cgx"]
    assert cgx.provides == frozenset({"allreduce"})
    assert not cgx.automatic  # lossy: only the user may pick it


def test_impl_cgx_is_the_quantized_allreduce(nearest_4_bits: None) -> None:
    t = _mine(10_000)
    expected = mq.allreduce(t.clone(), op="avg", config=mq.CompressionConfig.from_env())
    assert allreduce(t, "avg", impl="cgx", timeout=120) is t
    assert torch.equal(t, expected)
    if world().size > 1:  # compressed: not the exact mean
        exact = _mine(10_000)
        allreduce(exact, "avg", timeout=120)
        assert not torch.equal(t, exact)
        assert float((t - exact).abs().max()) < 0.5 * float(exact.abs().max())


def test_impl_cgx_asynchronous_and_by_setting(
    nearest_4_bits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = _mine(4096)
    expected = mq.allreduce(t.clone(), config=mq.CompressionConfig.from_env())
    handle = allreduce(t, impl="cgx", async_op=True, timeout=120)
    assert torch.equal(handle.wait(), expected)
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "cgx")
    reload_settings()
    u = _mine(4096)
    allreduce(u, timeout=120)
    assert torch.equal(u, expected)
    b = torch.full((3,), float(world().rank))
    broadcast(b, 0, timeout=120)  # cgx has no broadcast: mpi's runs it
    assert torch.equal(b, torch.zeros(3))
    monkeypatch.delenv("MPX_COLLECTIVES_IMPL")
    reload_settings()


def test_impl_cgx_refuses_what_it_cannot_reduce(monkeypatch: pytest.MonkeyPatch) -> None:
    # Its registry declaration (reduce_ops), before anything moves, on every rank.
    with pytest.raises(ValueError, match=r"impl='cgx' reduces with avg, sum, got op='max'"):
        allreduce(torch.ones(64), "max", impl="cgx", timeout=60)
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "cgx")
    reload_settings()
    m = torch.full((64,), float(world().rank))
    allreduce(m, "max", timeout=60)  # every call's default declines it: auto's runs it
    assert torch.equal(m, torch.full((64,), float(world().size - 1)))
    monkeypatch.delenv("MPX_COLLECTIVES_IMPL")
    reload_settings()
    with pytest.raises(ValueError, match=r"impl must be 'auto' or one of .*cgx.*'cgz'"):
        allreduce(torch.ones(64), impl="cgz", timeout=60)
    t = torch.ones(64)
    allreduce(t, timeout=60)  # the ranks are in step after both
    assert torch.equal(t, torch.full((64,), float(world().size)))


def _of_rank(n: int, rank: int) -> torch.Tensor:
    """``_mine(n)`` of ``rank``: every rank can rebuild every rank's data (the exact sum)."""
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank)) * (rank + 1)


def test_impl_cgx_by_setting_takes_every_size(
    nearest_4_bits: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """MPX_COLLECTIVES_IMPL=cgx: a 1-element allreduce (a loss) recursed without end.

    The compressed allreduce reduces what it leaves uncompressed (too small,
    an integer dtype) with mpx.collectives' allreduce; without a name that
    was MPX_COLLECTIVES_IMPL's choice, cgx itself, again and again.
    """
    rank, size = world().rank, world().size
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "cgx")
    reload_settings()
    try:
        loss = torch.tensor([float(rank + 1)])
        allreduce(loss, "avg", timeout=120)
        assert loss.item() == (size + 1) / 2  # exact: not compressed
        counts = torch.arange(10) * (rank + 1)
        allreduce(counts, timeout=120)
        assert counts.tolist() == [i * size * (size + 1) // 2 for i in range(10)]
        small = torch.full((15,), 0.25 * (rank + 1))  # one below the smallest compressed
        allreduce(small, timeout=120)
        assert torch.equal(small, torch.full((15,), 0.25 * size * (size + 1) / 2))
        big = _of_rank(10_000, rank)
        expected = mq.allreduce(big.clone(), config=mq.CompressionConfig.from_env())
        allreduce(big, timeout=120)
        assert torch.equal(big, expected)  # the quantized allreduce ran
        every = [_of_rank(10_000, r) for r in range(size)]
        exact = torch.stack(every).sum(0)
        # Nearest rounding to one of 16 levels: off by at most half a level of each
        # rank's values (a range <= rank r's whole range), and half a level of the
        # owner's partial sum (a range <= the sum of those ranges).
        ranges = sum(float(x.max() - x.min()) for x in every)
        assert float((big - exact).abs().max()) <= ranges / 15 + 1e-4
        if size > 1:
            assert not torch.equal(big, exact)
    finally:
        monkeypatch.delenv("MPX_COLLECTIVES_IMPL")
        reload_settings()
