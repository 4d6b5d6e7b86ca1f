"""Splitting an ``nn.Sequential`` into contiguous stages.

::

    module:   [ L0 | L1 | L2 | L3 | L4 | L5 | L6 ]
    balance:  [    3         |  2      |   2     ]      sum(balance) == len(module)
    stages:      rank 0        rank 1     rank 2        len(balance) == ranks

``balance_by_time`` measures each layer's forward + backward time on a sample
and picks the contiguous split whose slowest stage is fastest (the classic
linear-partition dynamic program).

With several virtual stages per rank, a rank's time is the sum of its chunks,
and the split whose slowest chunk is fastest can load one rank more than
another. Given each virtual stage's rank, ``split_times`` looks for the split
whose busiest *rank* is least busy, then whose slowest chunk is fastest (given
the micro-batches per step too, the split with the shortest estimated step:
``chunks × busiest rank + (ranks − 1) × slowest chunk``)::

    layer times:  2 | 3 2 | 3 2 | 2 2 2        parts 2 5 5 4: slowest part 5
    V ranks:      0    1     1      0          rank 0: 6, rank 1: 10

    layer times:  2 | 3 | 2 3 | 2 2 2          parts 2 3 5 6: slowest part 6
    V ranks:      0   1    1      0            rank 0: 8, rank 1: 8
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from mpx.pipeline.errors import PipelineValueError
from mpx.pipeline.model.border import flatten, map_tensors
from mpx.pipeline.model.skip import tracking

__all__ = [
    "balance_by_time",
    "check_balance",
    "has_inplace",
    "layer_times",
    "split_times",
    "stage_bounds",
    "tied_groups",
]


def check_balance(balance: Sequence[int], num_layers: int, num_stages: int) -> list[int]:
    """Validates ``balance``; returns it as a list.

    Raises:
        PipelineValueError: wrong length, a stage without layers, or a sum that is
            not the number of layers.
    """
    balance = list(balance)
    if len(balance) != num_stages:
        raise PipelineValueError(
            f"balance={balance} has {len(balance)} stages but the pipeline has "
            f"{num_stages} (ranks x stages_per_rank); give one entry per stage"
        )
    if any((not isinstance(b, int)) or b < 1 for b in balance):
        raise PipelineValueError(f"balance={balance}: every stage needs at least one layer")
    if sum(balance) != num_layers:
        raise PipelineValueError(
            f"balance={balance} sums to {sum(balance)} but the module has {num_layers} "
            "layers; the entries must add up to len(module)"
        )
    return balance


def stage_bounds(balance: Sequence[int], stage: int) -> tuple[int, int]:
    """``[start, stop)`` global layer indices of ``stage``."""
    start = sum(balance[:stage])
    return start, start + balance[stage]


def tied_groups(module: nn.Sequential, balance: Sequence[int]) -> list[dict[int, tuple[int, str]]]:
    """Parameters shared by layers of different stages (tied weights), in module order.

    Returns:
        Per shared parameter, ``{stage: (layer index, name in that layer)}`` for
        each stage using it (its first use there). Sharing within one stage is
        not listed: it needs nothing.
    """
    uses: dict[int, dict[int, tuple[int, str]]] = {}  # id(param) -> {stage: (layer, name)}
    stage = 0
    for index, layer in enumerate(module):
        while index >= sum(balance[: stage + 1]):
            stage += 1
        for name, param in layer.named_parameters():
            uses.setdefault(id(param), {}).setdefault(stage, (index, name))
    return [owners for owners in uses.values() if len(owners) > 1]


def has_inplace(layer: nn.Module) -> bool:
    """True if ``layer`` (or a submodule) is flagged ``inplace=True`` (ReLU, Dropout, ...)."""
    return any(getattr(m, "inplace", False) is True for m in layer.modules())


def layer_times(module: nn.Sequential, sample: Any, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward per layer on ``sample``: the fastest of ``repeats``
    after one untimed pass.

    The untimed pass takes the first call's one-time costs (allocations, lazy
    initialisation); the fastest, not the median, since on a shared machine
    other work only adds time. Under the median of three with the cold pass
    among them, a transformer's eight equal blocks measured 17-21 ms, enough
    to cut a V 2 2 2 4 instead of 3 2 2 3 one time in four.

    ``sample`` may be a structure (see :mod:`mpx.pipeline.model.border`); skip
    connections are followed, each layer timed on its own (inputs and skips
    detached before it).
    """
    times: list[list[float]] = [[] for _ in module]
    for _ in range(repeats + 1):
        x = sample
        skips: dict[str, torch.Tensor] = {}
        with tracking(skips):
            for i, layer in enumerate(module):
                x = map_tensors(_fresh_leaf, x)
                for name, t in skips.items():
                    skips[name] = _fresh_leaf(t)
                start = time.perf_counter()
                y = layer(map_tensors(torch.clone, x) if has_inplace(layer) else x)
                outs = [t for t in flatten(y)[0] if t.requires_grad]
                if outs:
                    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
                times[i].append(time.perf_counter() - start)
                x = y
    module.zero_grad(set_to_none=True)
    return [min(t[1:]) for t in times]


def _fresh_leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(t.is_floating_point())


# Splits tried by the rank-aware search before it settles for the best so far
# (a few hundred thousand: well under a second; 10 layers in 6 chunks are 126).
_SEARCH_LIMIT = 200_000


def split_times(
    times: Sequence[float],
    num_stages: int,
    ranks: Sequence[int] | None = None,
    chunks: int | None = None,
) -> list[int]:
    """The contiguous split of ``times`` into ``num_stages`` non-empty parts
    whose largest sum is smallest.

    Args:
        ranks: the rank of each part (virtual stage), when a rank runs several.
            Then a step takes about ``chunks × busiest rank + (ranks − 1) ×
            slowest part`` (the steady state, then the pipeline's fill and
            drain), and the split minimizes that estimate.
        chunks: micro-batches per step (with ``ranks``); None weighs the
            busiest rank first and the slowest part only to break ties.

    The search is exact up to ``_SEARCH_LIMIT`` splits tried, else the best of
    those, never worse than the plain split.

    Raises:
        PipelineValueError: fewer layers than stages, or ``ranks`` not one per stage.
    """
    balance = _split_parts(times, num_stages)
    if ranks is None:
        return balance
    if len(ranks) != num_stages:
        raise PipelineValueError(
            f"ranks={list(ranks)} names {len(ranks)} stages' ranks, but there are "
            f"{num_stages} stages: give one rank per virtual stage"
        )
    if chunks is not None and chunks < 1:
        raise PipelineValueError(f"chunks={chunks} must be at least 1 (micro-batches per step)")
    if len(set(ranks)) == len(ranks):
        return balance  # a part per rank: the plain split is already the answer
    return _split_by_rank(times, list(ranks), chunks, balance)


def _prefix_sums(times: Sequence[float]) -> list[float]:
    """``[0, t0, t0 + t1, ...]``: any run of layers' time as one difference."""
    return [0.0, *itertools.accumulate(times)]


def _step_cost(busiest: float, largest: float, fill: int, chunks: int | None) -> tuple[float, ...]:
    """What the rank-aware search minimizes (see :func:`split_times`)."""
    if chunks is None:
        return (busiest, largest)
    return (chunks * busiest + fill * largest,)


def _cost(
    prefix: Sequence[float], balance: Sequence[int], ranks: Sequence[int], chunks: int | None
) -> tuple[float, ...]:
    loads = dict.fromkeys(ranks, 0.0)
    largest, i = 0.0, 0
    for rank, size in zip(ranks, balance, strict=True):
        part = prefix[i + size] - prefix[i]
        loads[rank] += part
        largest = max(largest, part)
        i += size
    return _step_cost(max(loads.values()), largest, len(loads) - 1, chunks)


def _split_by_rank(
    times: Sequence[float], ranks: list[int], chunks: int | None, start: list[int]
) -> list[int]:
    """Branch and bound over the cut positions, from the plain split's cost."""
    n, k = len(times), len(ranks)
    fill = len(set(ranks)) - 1
    prefix = _prefix_sums(times)
    best, best_cost = list(start), _cost(prefix, start, ranks, chunks)
    loads = dict.fromkeys(ranks, 0.0)
    sizes: list[int] = []
    budget = _SEARCH_LIMIT

    def search(part: int, i: int, busiest: float, largest: float) -> None:
        nonlocal best, best_cost, budget
        budget -= 1
        rank = ranks[part]
        if part == k - 1:  # the last part takes the layers left
            piece = prefix[n] - prefix[i]
            cost = _step_cost(max(busiest, loads[rank] + piece), max(largest, piece), fill, chunks)
            if cost < best_cost:
                best, best_cost = [*sizes, n - i], cost
            return
        for j in range(i + 1, n - (k - 1 - part) + 1):  # this part: layers [i, j)
            if budget <= 0:
                return
            piece = prefix[j] - prefix[i]
            load = loads[rank] + piece
            # What is chosen so far bounds the cost from below; a longer part
            # only raises it.
            bound = _step_cost(max(busiest, load), max(largest, piece), fill, chunks)
            if bound[0] > best_cost[0]:
                break
            loads[rank] = load
            sizes.append(j - i)
            search(part + 1, j, max(busiest, load), max(largest, piece))
            sizes.pop()
            loads[rank] -= piece

    search(0, 0, 0.0, 0.0)
    return best


def _split_parts(times: Sequence[float], num_stages: int) -> list[int]:
    """The plain split: the linear-partition dynamic program over part sums."""
    n = len(times)
    if n < num_stages:
        raise PipelineValueError(
            f"the module has {n} layers, fewer than the {num_stages} stages (ranks); "
            "use fewer ranks or split the model into more layers"
        )
    prefix = _prefix_sums(times)
    inf = float("inf")
    # best[k][i]: the smallest possible slowest stage for layers [0, i) in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    balance, i = [], n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        balance.append(i - j)
        i = j
    return balance[::-1]


def balance_by_time(
    module: nn.Sequential,
    sample: Any,
    num_stages: int,
    ranks: Sequence[int] | None = None,
    chunks: int | None = None,
) -> list[int]:
    """Profiles ``module`` on ``sample`` and balances it over ``num_stages``
    (over their ``ranks``' loads when given, see :func:`split_times`)."""
    return split_times(layer_times(module, sample), num_stages, ranks, chunks)
