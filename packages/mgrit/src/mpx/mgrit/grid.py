"""The multilevel time grid and its split into blocks, one per rank.

Level 0 is the fine grid of ``nt`` intervals; level ``l+1`` keeps every
``cfactor[l]``-th point of level ``l`` (its C-points). The blocks are whole
intervals of the *coarsest* level, so on every level each rank holds whole
C-intervals and F-relaxation never needs a neighbour's F-point::

    fine   0  1  2  3  4  5  6  7  8  9 10 11 12      nt = 12, cfactor 2, 3 levels
    lvl 1  0     2     4     6     8    10    12
    lvl 2  0           4           8          12      coarsest: 3 intervals
           |  rank 0   |   rank 1  |  rank 2  |
           rank r stores (its first point - 1) as ghost row 0 (rank 0: the point t0)

Each rank's block on a level is a tensor of ``count + 1`` rows: row 0 is the
last point of the left neighbour (a C-point, kept up to date by exchange), rows
``1..count`` are owned. Blocks split the coarsest intervals as evenly as
possible, earlier ranks taking the remainder (as PyMGRIT does); a rank may hold
none when there are more ranks than coarsest intervals.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpx.mgrit.errors import MGRITConfigError

__all__ = ["Layout", "Level", "coarsening_factors", "split_evenly"]


def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous blocks, sizes differing by at most one."""
    return [n // parts + (1 if p < n % parts else 0) for p in range(parts)]


def coarsening_factors(cfactor: int | Sequence[int], levels: int) -> list[int]:
    """One coarsening factor per coarsening (``levels - 1`` of them), validated."""
    if isinstance(levels, bool) or not isinstance(levels, int) or levels < 1:
        raise MGRITConfigError(f"levels must be an int >= 1, got {levels!r}")
    if isinstance(cfactor, int):
        factors = [cfactor] * (levels - 1)
    else:
        factors = list(cfactor)
        if len(factors) < levels - 1:
            raise MGRITConfigError(
                f"cfactor={factors!r} has {len(factors)} entries but levels={levels} needs "
                f"{levels - 1} (one per coarsening); give an int or a longer list"
            )
        factors = factors[: levels - 1]
    for m in factors:
        if isinstance(m, bool) or not isinstance(m, int) or m < 2:
            raise MGRITConfigError(
                f"every coarsening factor must be an int >= 2, got cfactor={cfactor!r}; "
                "use cfactor=2 or more (1 would not coarsen)"
            )
    return factors


@dataclass(frozen=True)
class Level:
    """One level of one rank's block.

    Attributes:
        index: level number (0 = fine).
        stride: fine intervals per interval of this level.
        cfactor: coarsening to the next level (1 on the coarsest: all points are C-points).
        first: global index, on this level, of the block's row 0.
        count: owned points (rows ``1..count``).
        times: global times of rows ``0..count`` (float64).

    Example::

        lv = Layout(0.0, 1.0, nt=8, levels=2, cfactor=2, size=1, rank=0).levels[1]
        (lv.stride, lv.count, lv.times[1])   # (2, 4, 0.25)
    """

    index: int
    stride: int
    cfactor: int
    first: int
    count: int
    times: np.ndarray

    @property
    def dts(self) -> np.ndarray:
        """``times[i+1] - times[i]`` for rows ``0..count-1``: the step from row i."""
        return np.diff(self.times)


class Layout:
    """The levels of every rank's block for a grid of ``nt`` intervals on [t0, tf].

    ``blocks`` (coarsest intervals per rank) overrides the even split; the adjoint
    of a layer-parallel network uses it to put each layer on the rank that holds it.

    Example::

        lay = Layout(t0=0.0, tf=5.0, nt=100, levels=2, cfactor=2, size=3, rank=1)
        lay.levels[0].first, lay.levels[0].count    # (34, 34): fine points 35..68
        lay.left, lay.right                         # (0, 2)
    """

    def __init__(
        self,
        t0: float,
        tf: float,
        nt: int,
        levels: int,
        cfactor: int | Sequence[int],
        size: int,
        rank: int,
        blocks: Sequence[int] | None = None,
    ) -> None:
        if isinstance(nt, bool) or not isinstance(nt, int) or nt < 1:
            raise MGRITConfigError(f"nt (number of time steps) must be an int >= 1, got {nt!r}")
        if not tf > t0:
            raise MGRITConfigError(f"need tf > t0, got t0={t0!r}, tf={tf!r}")
        self.factors = coarsening_factors(cfactor, levels)
        span = math.prod(self.factors)
        if nt % span != 0:
            allowed, prod = 1, 1
            for m in self.factors:
                if nt % (prod * m) != 0:
                    break
                prod *= m
                allowed += 1
            raise MGRITConfigError(
                f"nt={nt} is not divisible by the product of the coarsening factors "
                f"{'*'.join(map(str, self.factors))}={span} that levels={levels} needs: every "
                f"coarse point must be a fine point. Use nt a multiple of {span}, or "
                f"levels <= {allowed} (more levels than this grid allows)"
            )
        self.nt = nt
        self.t0 = float(t0)
        self.tf = float(tf)
        self.size = size
        self.rank = rank
        # The fine times as PyMGRIT and numpy make them; coarse levels are slices of them.
        fine = np.linspace(self.t0, self.tf, nt + 1)
        coarsest = nt // span
        if blocks is None:
            blocks = split_evenly(coarsest, size)
        elif len(blocks) != size or sum(blocks) != coarsest or min(blocks) < 0:
            raise MGRITConfigError(
                f"blocks={list(blocks)!r} must give each of the {size} ranks a number >= 0 of "
                f"coarsest intervals, {coarsest} in all"
            )
        blocks = list(blocks)
        starts = np.concatenate([[0], np.cumsum(blocks)]).astype(int)
        self.blocks = blocks
        self.levels: list[Level] = []
        stride = 1
        for index in range(levels):
            per_coarsest = span // stride  # this level's intervals per coarsest interval
            first = int(starts[rank]) * per_coarsest
            count = blocks[rank] * per_coarsest
            times = fine[::stride][first : first + count + 1]
            m = self.factors[index] if index < levels - 1 else 1
            self.levels.append(Level(index, stride, m, first, count, times))
            stride *= m
        holders = [r for r in range(size) if blocks[r] > 0]
        before = [r for r in holders if r < rank]
        after = [r for r in holders if r > rank]
        self.left: int | None = before[-1] if before and blocks[rank] > 0 else None
        self.right: int | None = after[0] if after and blocks[rank] > 0 else None
        #: the rank that holds the final time point
        #: the ranks that hold the first and the final time point
        self.first_rank: int = holders[0]
        self.last_rank: int = holders[-1]

    @property
    def holds_start(self) -> bool:
        """Whether this rank's row 0 is the point t0 (owned, not a ghost)."""
        return self.rank == self.first_rank

    @property
    def active(self) -> bool:
        """Whether this rank holds any time points."""
        return self.blocks[self.rank] > 0

    def fine_indices(self) -> range:
        """Global fine indices of the rows this rank owns (rank 0 also owns point 0)."""
        lv = self.levels[0]
        start = lv.first if self.holds_start else lv.first + 1
        return range(start, lv.first + lv.count + 1) if self.active else range(0)
