"""Partitioning: balance checks, the time-balancing split, tied weights."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpx.pipeline import PipelineError, balance_by_time, split_times
from mpx.pipeline.model.partition import check_balance, has_inplace, layer_times, stage_bounds


def brute_force(times: list[float], k: int) -> float:
    n = len(times)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(times[a:b]) for a, b in itertools.pairwise(edges)))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_split_is_optimal(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n = int(torch.randint(3, 9, (1,), generator=g))
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    times = torch.rand(n, generator=g).tolist()
    balance = split_times(times, k)
    assert len(balance) == k
    assert sum(balance) == n
    assert min(balance) >= 1
    edges = [0, *itertools.accumulate(balance)]
    slowest = max(sum(times[a:b]) for a, b in itertools.pairwise(edges))
    assert slowest == pytest.approx(brute_force(times, k))


def by_rank(times: list[float], balance: list[int], ranks: list[int]) -> tuple[float, float]:
    """(the busiest rank's sum, the largest part) of a split."""
    edges = [0, *itertools.accumulate(balance)]
    parts = [sum(times[a:b]) for a, b in itertools.pairwise(edges)]
    loads = [sum(x for x, r in zip(parts, ranks, strict=True) if r == q) for q in set(ranks)]
    return max(loads), max(parts)


def step_cost(
    times: list[float], balance: list[int], ranks: list[int], chunks: int | None
) -> tuple[float, ...]:
    """What split_times minimizes with ranks: written out again, independently."""
    busiest, largest = by_rank(times, balance, ranks)
    if chunks is None:
        return busiest, largest
    return (chunks * busiest + (len(set(ranks)) - 1) * largest,)


def brute_force_by_rank(
    times: list[float], ranks: list[int], chunks: int | None
) -> tuple[float, ...]:
    n, k = len(times), len(ranks)
    costs = []
    for cuts in itertools.combinations(range(1, n), k - 1):
        balance = [b - a for a, b in itertools.pairwise([0, *cuts, n])]
        costs.append(step_cost(times, balance, ranks, chunks))
    return min(costs)


@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("style", ["loop", "v"])
@pytest.mark.parametrize("chunks", [None, 1, 8])
def test_split_by_rank_is_optimal(seed: int, style: str, chunks: int | None) -> None:
    g = torch.Generator().manual_seed(seed)
    p = int(torch.randint(2, 4, (1,), generator=g))
    k = 2 * p
    n = int(torch.randint(k, 13, (1,), generator=g))
    ranks = [s % p for s in range(k)] if style == "loop" else [*range(p), *reversed(range(p))]
    times = torch.rand(n, generator=g).tolist()
    balance = split_times(times, k, ranks, chunks)
    assert len(balance) == k
    assert sum(balance) == n
    assert min(balance) >= 1
    got = step_cost(times, balance, ranks, chunks)
    assert got == pytest.approx(brute_force_by_rank(times, ranks, chunks))
    # Never worse than the split that balances parts alone.
    assert got <= step_cost(times, split_times(times, k), ranks, chunks)


def test_split_by_rank_balances_a_v() -> None:
    times = [2.0, 3.0, 2.0, 3.0, 2.0, 2.0, 2.0]  # the module docstring's example
    v = [0, 1, 1, 0]
    assert split_times(times, 4) == [1, 2, 2, 2]  # parts 2 5 5 4: ranks 6 and 10
    assert by_rank(times, [1, 2, 2, 2], v) == (10.0, 5.0)
    assert split_times(times, 4, v) == [1, 1, 2, 3]  # parts 2 3 5 6: ranks 8 and 8
    assert by_rank(times, [1, 1, 2, 3], v) == (8.0, 6.0)
    assert split_times(times, 2, [0, 1]) == split_times(times, 2)  # a part per rank
    with pytest.raises(PipelineError, match=r"ranks=\[0, 1\] names 2 stages' ranks"):
        split_times(times, 4, [0, 1])
    with pytest.raises(PipelineError, match="chunks=0 must be at least 1"):
        split_times(times, 4, v, 0)


def test_split_by_rank_weighs_the_fill_against_the_steady_state() -> None:
    # Measured times of an embedding, 8 blocks and a head on a V of 2 ranks: the
    # least busy rank alone takes chunks of 1, 1, 3 and 5 layers (ranks 4.20 and
    # 4.17, a chunk of 4.1 to fill and drain); at 8 micro-batches a step is
    # shorter with 3, 2, 2, 3 (ranks 4.23 and 4.14, chunks of at most 2.15).
    times = [0.1, 1.0, 1.05, 1.0, 0.95, 1.0, 1.02, 0.98, 1.0, 0.1]
    v = [0, 1, 1, 0]
    assert split_times(times, 4, v) == [1, 1, 3, 5]
    assert by_rank(times, [1, 1, 3, 5], v) == pytest.approx((4.2, 4.1))
    assert split_times(times, 4, v, chunks=8) == [3, 2, 2, 3]
    assert by_rank(times, [3, 2, 2, 3], v) == pytest.approx((4.23, 2.15))


def test_split_by_rank_stops_searching_at_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpx.pipeline.model import partition

    times = torch.rand(40, generator=torch.Generator().manual_seed(0)).tolist()
    ranks = [s % 4 for s in range(8)]
    monkeypatch.setattr(partition, "_SEARCH_LIMIT", 50)
    balance = split_times(times, 8, ranks)
    assert sum(balance) == 40
    assert len(balance) == 8
    plain = by_rank(times, split_times(times, 8), ranks)
    assert by_rank(times, balance, ranks)[0] <= plain[0] + 1e-12


def test_split_needs_enough_layers() -> None:
    with pytest.raises(PipelineError, match="fewer than the 3 stages"):
        split_times([1.0, 2.0], 3)


def test_check_balance_messages() -> None:
    assert check_balance([2, 3], 5, 2) == [2, 3]
    with pytest.raises(PipelineError, match=r"balance=\[2, 3\] has 2 stages"):
        check_balance([2, 3], 5, 3)
    with pytest.raises(PipelineError, match="sums to 5 but the module has 6"):
        check_balance([2, 3], 6, 2)
    with pytest.raises(PipelineError, match="at least one layer"):
        check_balance([0, 5], 5, 2)
    assert stage_bounds([2, 3, 1], 1) == (2, 5)


def test_layer_times_and_inplace_detection() -> None:
    model = nn.Sequential(nn.Linear(4, 400), nn.ReLU(inplace=True), nn.Linear(400, 400))
    times = layer_times(model, torch.randn(64, 4))
    assert len(times) == 3
    assert all(t > 0 for t in times)
    assert all(p.grad is None for p in model.parameters())
    assert has_inplace(model[1])
    assert not has_inplace(model[0])


def test_layer_times_follow_structures_and_skips() -> None:
    # A dict sample, a bool mask, a skip from layer 0 to layer 2: every layer is timed.
    from collections.abc import Generator
    from typing import Any

    from mpx.pipeline import Keyed, pop, skippable, stash
    from mpx.pipeline.model.skip import Pop, Stash

    @skippable(stash=["s"])
    class Keep(nn.Module):
        def forward(self, x: dict[str, Any]) -> Generator[Stash | Pop, Any, dict[str, Any]]:
            yield stash("s", x["h"])
            return x

    @skippable(pop=["s"])
    class Use(nn.Module):
        def forward(self, x: dict[str, Any]) -> Generator[Stash | Pop, Any, torch.Tensor]:
            s: torch.Tensor = yield pop("s")
            h: torch.Tensor = x["h"] * x["mask"]
            return h + s

    model = nn.Sequential(Keep(), Keyed(nn.Linear(4, 4), "h", "h"), Use())
    sample = {"h": torch.randn(3, 4), "mask": torch.ones(3, 4, dtype=torch.bool)}
    times = layer_times(model, sample)
    assert len(times) == 3
    assert all(t > 0 for t in times)
    assert len(balance_by_time(model, sample, 2)) == 2
