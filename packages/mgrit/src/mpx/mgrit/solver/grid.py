"""The multilevel time grid and its split into blocks, one per rank.

Level 0 is the fine grid of ``nt`` intervals; level ``l+1`` keeps every
``cfactor[l]``-th point of level ``l`` (its C-points). The *fine* grid is split
into contiguous blocks, one per rank (whole fine C-intervals by default, as
XBraid's ``_braid_GetDistribution`` splits it); on every coarser level a rank
owns the coarse points that lie in its fine block, possibly none. So every rank
works on the fine level at any depth of the hierarchy, and the coarsest grid can
be a handful of points::

    fine   0  1  2  3  4  5  6  7  8  9 10 11 12      nt = 12, cfactor 2, 3 levels
    lvl 1  0     2     4     6     8    10    12
    lvl 2  0           4           8          12      coarsest: 3 intervals
           | rank 0 |  rank 1  | rank 2 |  rank 3 |  fine blocks of 4, 2, 4, 2 ... or any
           a rank's row 0 is the point before its first owned one, owned by the
           nearest rank on the left that owns points on that level (or t0 itself)

Each rank's block on a level is a tensor of ``count + 1`` rows: row 0 is the
point just before its owned ones (a ghost, kept up to date by exchange with
``Level.left``; it may be an F-point of that level, or the point t0, which every
rank knows), rows ``1..count`` are owned. A rank that owns no points on a level
takes no part in that level's relaxation. Interval boundaries and rank
boundaries are independent: an interval that crosses ranks is relaxed as a
chain, rank after rank, within one sweep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from mpx.mgrit.errors import MGRITConfigError

__all__ = ["Layout", "Level", "coarsening_factors", "fine_blocks", "split_evenly"]


def split_evenly(n: int, parts: int) -> list[int]:
    """``n`` items in ``parts`` contiguous blocks, sizes differing by at most one."""
    return [n // parts + (1 if p < n % parts else 0) for p in range(parts)]


def fine_blocks(nt: int, unit: int, size: int) -> list[int]:
    """Fine intervals per rank: ``nt`` split evenly over ``size`` ranks in whole units of
    ``unit`` intervals (the finest C-interval), earlier ranks taking the remainder."""
    return [n * unit for n in split_evenly(nt // unit, size)]


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
        left: the rank that owns row 0 (None: row 0 is t0, or nothing is owned here).
        right: the next rank that owns points on this level (None: none, or nothing owned).

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
    left: int | None = None
    right: int | None = None

    @property
    def dts(self) -> np.ndarray:
        """``times[i+1] - times[i]`` for rows ``0..count-1``: the step from row i."""
        return np.diff(self.times)

    @property
    def first_c(self) -> int:
        """The row of the first owned C-point (``count + 1`` or more when none is owned)::

        first = 5, cfactor 4:  rows 0 1 2 3 4 ...  are points 5 6 7 8 9: first_c = 3
        """
        return self.cfactor - self.first % self.cfactor

    @property
    def c_count(self) -> int:
        """Owned C-points: rows ``first_c, first_c + cfactor, ... <= count``."""
        return max(0, (self.count - self.first_c) // self.cfactor + 1)

    @property
    def ends_on_c(self) -> bool:
        """Whether the last owned row is a C-point of this level (final before F-relaxation)."""
        return self.count > 0 and (self.first + self.count) % self.cfactor == 0


class Layout:
    """The levels of every rank's block for a grid of ``nt`` intervals on [t0, tf].

    ``blocks`` (fine intervals per rank, any split summing to ``nt``) overrides the
    even split in whole fine C-intervals; the adjoint of a layer-parallel network
    uses it to put each layer on the rank that holds it.

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
        if blocks is None:
            blocks = fine_blocks(nt, self.factors[0] if self.factors else 1, size)
        elif (
            len(blocks) != size
            or sum(blocks) != nt
            or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in blocks)
        ):
            raise MGRITConfigError(
                f"blocks={list(blocks)!r} must give each of the {size} ranks a number >= 0 of "
                f"fine time steps, {nt} in all (whole fine C-intervals keep the exchanges few)"
            )
        self.blocks = list(blocks)
        #: fine point index where each rank's block starts (its row 0), and the end
        self.starts = [int(s) for s in np.concatenate([[0], np.cumsum(self.blocks)])]
        # The fine times as PyMGRIT and numpy make them; coarse levels are slices of them.
        fine = np.linspace(self.t0, self.tf, nt + 1)
        self.levels: list[Level] = []
        stride = 1
        for index in range(levels):
            m = self.factors[index] if index < levels - 1 else 1
            first, count = self.span(rank, stride)
            owners = [r for r in range(size) if self.span(r, stride)[1] > 0]
            left = max((r for r in owners if r < rank), default=None)
            right = min((r for r in owners if r > rank), default=None)
            active = count > 0
            self.levels.append(
                Level(
                    index, stride, m, first, count, fine[::stride][first : first + count + 1],
                    left=left if active and first > 0 else None,
                    right=right if active else None,
                )
            )  # fmt: skip
            stride *= m
        holders = [r for r in range(size) if self.blocks[r] > 0]
        self.left: int | None = self.levels[0].left
        self.right: int | None = self.levels[0].right
        #: the ranks that hold the first and the final time point
        self.first_rank: int = holders[0]
        self.last_rank: int = holders[-1]

    def span(self, rank: int, stride: int) -> tuple[int, int]:
        """``(first, count)`` of ``rank`` on the level of ``stride``: row 0's index there
        and the points owned (those of the fine block ``(start, stop]`` on that level)."""
        first = self.starts[rank] // stride
        return first, self.starts[rank + 1] // stride - first

    @property
    def holds_start(self) -> bool:
        """Whether this rank's row 0 is the point t0 (owned, not a ghost)."""
        return self.rank == self.first_rank

    @property
    def active(self) -> bool:
        """Whether this rank holds any time points."""
        return self.blocks[self.rank] > 0

    def c_counts(self, index: int = 0) -> list[int]:
        """C-points of level ``index`` owned by each rank, in rank order."""
        lv = self.levels[index]
        counts = []
        for r in range(self.size):
            first, count = self.span(r, lv.stride)
            counts.append((first + count) // lv.cfactor - first // lv.cfactor)
        return counts

    def fine_indices(self) -> range:
        """Global fine indices of the rows this rank owns (rank 0 also owns point 0)."""
        lv = self.levels[0]
        start = lv.first if self.holds_start else lv.first + 1
        return range(start, lv.first + lv.count + 1) if self.active else range(0)
