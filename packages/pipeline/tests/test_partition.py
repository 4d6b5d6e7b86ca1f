"""Partitioning: balance checks, the time-balancing split, tied weights."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

from mpx.pipeline import PipelineError, balance_by_time, split_times
from mpx.pipeline.partition import check_balance, has_inplace, layer_times, stage_bounds


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
    from mpx.pipeline.skip import Pop, Stash

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
