"""What crosses ranks on each level of the time grid, and in which form.

On every level a rank's row 0 is the point just before its own (see
:mod:`mpx.mgrit.solver.grid`), owned by the nearest rank on the left that owns points
there. That rank sends it once it is final; rows 0 is only ever read as the
start of a step (the step to row 1, and the coarse step in a restriction).

With ``boundary_steps`` the sender may send that step's *result* instead of
the point: where the receiver's row 0 on a coarse level lies before its fine
block (its fine index ``first * stride`` is left of the block's start), the
step from it belongs to a layer the receiver does not hold. The sender computes
it from its last row and sends ``step(u_last)``; the receiver keeps that in row
0 (a "stepped" row 0) and adds it where it would have stepped row 0::

    rank r-1 (owns the point at fine 16)          rank r (fine block 18..24)
    level 2 rows [.. u_16]  -- step(u_16) -->     [S | u_32 ...]   u_32 = g_32 + S

Then every step a rank computes starts inside its fine block or at its last
point (the first step of the next rank's block): a layer-parallel network holds
its own layers and one of each neighbour's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from mpx.collectives import Channel, Communicator
from mpx.mgrit.solver.ghosts import Ghosts
from mpx.mgrit.solver.grid import Layout

__all__ = ["Boundaries"]


class Boundaries:
    """Per level of one rank's layout: its exchange, and whether row 0 and the row sent
    are points or steps from them.

    Attributes:
        ghosts: one :class:`~mpx.mgrit.solver.ghosts.Ghosts` per level, on one channel.
        stepped: per level, whether this rank's row 0 holds the left's step (not a point).
        sends_steps: per level, whether this rank sends the step from its last row.
        t0_sends, t0_recv: where row 0 is a stepped t0 (see the code).
        v_recv, v_send: per level ``l >= 1``, whether a restriction to ``l`` receives row 0
            of v from the left (it is not here) and sends its last row of v to the right.
        last_time, last_dt: per level, the time of this rank's last row and the step
            from it (NaN where there is no next point).

    Example::

        b = Boundaries(comm, layout, boundary_steps=True)
        b.stepped[2]      # row 0 of level 2 is the left neighbour's step from its point
    """

    def __init__(self, comm: Communicator, layout: Layout, boundary_steps: bool) -> None:
        channel = Channel(comm)
        self.comm, self.first_rank, self.channel = comm, layout.first_rank, channel
        self.ghosts = [Ghosts(comm, lv.left, lv.right, channel=channel) for lv in layout.levels]

        def stepped(rank: int, stride: int) -> bool:
            first, count = layout.span(rank, stride)
            return boundary_steps and count > 0 and first * stride < layout.starts[rank]

        self.stepped = [stepped(layout.rank, lv.stride) for lv in layout.levels]
        self.sends_steps = [
            lv.right is not None and stepped(lv.right, lv.stride) for lv in layout.levels
        ]
        # A stepped row 0 that is t0 has no left neighbour: the rank holding the first
        # step sends step(u0) on that level once per solve (u0 never changes).
        #: (level, rank) pairs this rank sends step(u0) to; levels it receives it on
        self.t0_sends: list[tuple[int, int]] = []
        self.t0_recv = [
            lvl for lvl, lv in enumerate(layout.levels) if self.stepped[lvl] and lv.first == 0
        ]
        if layout.rank == layout.first_rank:
            for lvl, lv in enumerate(layout.levels):
                owners = [r for r in range(layout.size) if layout.span(r, lv.stride)[1] > 0]
                if owners and owners[0] != layout.rank and stepped(owners[0], lv.stride):
                    self.t0_sends.append((lvl, owners[0]))
        size = len(layout.levels)
        self.v_recv, self.v_send = [False] * size, [False] * size
        for lvl in range(size - 1):
            fine, coarse = layout.levels[lvl], layout.levels[lvl + 1]
            self.v_recv[lvl + 1] = coarse.left is not None and (
                fine.first % fine.cfactor != 0 or self.stepped[lvl + 1]
            )
            if coarse.right is not None:
                theirs = layout.span(coarse.right, fine.stride)[0]
                self.v_send[lvl + 1] = theirs % fine.cfactor != 0 or self.sends_steps[lvl + 1]
        fine_times = np.linspace(layout.t0, layout.tf, layout.nt + 1)
        #: per level, the step from t0 (its own np.diff, as the single rank's)
        self.first_dt = [float(np.diff(fine_times[:: lv.stride][:2])[0]) for lv in layout.levels]
        self.last_time: list[float] = []
        self.last_dt: list[float] = []
        for lv in layout.levels:
            points, i = fine_times[:: lv.stride], lv.first + lv.count
            # As the single rank computes the step from this point: its own np.diff.
            self.last_time.append(float(points[i]))
            after = np.diff(points[i : i + 2])
            self.last_dt.append(float(after[0]) if after.size else np.nan)

    def t0_steps(
        self, step_of_u0: Callable[[int], torch.Tensor], rows: Sequence[torch.Tensor]
    ) -> None:
        """Where row 0 of a level is a stepped t0: the rank holding the first step sends
        ``step_of_u0(level)`` to the rank that needs it, which keeps it in ``rows[level]``
        (row 0 of that level). Once per solve; no-op elsewhere."""
        tags = len(self.ghosts)  # tags of their own, past the levels'
        shifts = [
            Ghosts(self.comm, None, rank, self.channel).start(step_of_u0(lvl), None, tag=tags + lvl)
            for lvl, rank in self.t0_sends
        ]
        for lvl in self.t0_recv:
            left = Ghosts(self.comm, self.first_rank, None, self.channel)
            left.start(None, rows[lvl], tag=tags + lvl).finish()
        for shift in shifts:
            shift.finish()
