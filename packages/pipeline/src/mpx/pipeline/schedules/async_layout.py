"""The asynchronous stream (``schedule="async"``) as lists of actions, call after call.

One stage per rank follows PipeDream's rule (:func:`async_ops`): a forward
iff ``done_fwds − done_bwds <= depth``, with no flush, so the stream runs on
from call to call; :func:`async_actions` adds the optimizer steps and, for a
split backward, ``I`` then ``W``. With several chunks per rank, or a split
backward, :class:`AsyncLayout` lays every rank's chunks out by a list
scheduler continued from call to call. What the stream does with the
weights is :mod:`mpx.pipeline.runtime.stale`'s.
"""

from __future__ import annotations

from mpx.pipeline.errors import PipelineError
from mpx.pipeline.schedules.actions import Action, Op

__all__ = ["AsyncLayout", "async_actions", "async_flush_actions", "async_ops", "flush_ops"]


def async_ops(depth: int, done_fwds: int, done_bwds: int, total: int) -> list[Op]:
    """One call of the asynchronous schedule.

    Args:
        depth: number of stages after this one.
        done_fwds, done_bwds: passes this stage has run so far.
        total: micro-batches enqueued so far, this call's included.

    Returns:
        Forward iff ``done_fwds - done_bwds <= depth`` (while forwards are
        left), else backward; after the last forward, backwards until the rule
        would allow a forward again.
    """
    ops: list[Op] = []
    f, b = done_fwds, done_bwds
    while True:
        if f - b <= depth:
            if f == total:
                return ops
            ops.append(("F", f))
            f += 1
        else:
            ops.append(("B", b))
            b += 1


def async_actions(
    depth: int,
    done_fwds: int,
    done_bwds: int,
    total: int,
    stage: int,
    step_every: int = 0,
    split: bool = False,
) -> list[Action]:
    """:func:`async_ops` as actions of ``stage``, with a ``STEP`` after every
    ``step_every``-th backward (none for ``step_every=0``); with ``split`` each
    backward is ``I`` (its gradient goes upstream at once) then ``W``."""
    return _async_backwards(
        [(k, j) for k, j in async_ops(depth, done_fwds, done_bwds, total)],
        stage,
        step_every,
        split,
    )


def _async_backwards(ops: list[Op], stage: int, step_every: int, split: bool) -> list[Action]:
    out = []
    for kind, j in ops:
        if kind == "B" and split:
            out += [Action("I", j, stage), Action("W", j, stage)]
        else:
            out.append(Action(kind, j, stage))
        if kind == "B" and step_every and (j + 1) % step_every == 0:
            out.append(Action("STEP", j + 1, -1))
    return out


def async_flush_actions(
    done_fwds: int, done_bwds: int, stage: int, step_every: int = 0, split: bool = False
) -> list[Action]:
    """The backwards still owed (:func:`flush_ops`) as actions, with their steps and a
    last ``STEP`` for a partial accumulation."""
    out = _async_backwards(flush_ops(done_fwds, done_bwds), stage, step_every, split)
    if step_every and done_fwds % step_every:
        out.append(Action("STEP", done_fwds, -1))
    return out


class AsyncLayout:
    """The asynchronous stream over ``v`` chunks per rank (in a loop), laid out call by call.

    Every virtual stage ``s`` of the ``n = ranks·v`` is a PipeDream stage of
    its own (``depth = n − 1 − s``): it forwards micro-batch ``f`` only while
    ``f − b <= depth`` (``b`` backwards started), and its optimizer step (its
    chunk's parameters only) follows every ``step_every``-th of its
    backwards. A unit-time list scheduler over all ranks, run alike on every
    rank and continued from call to call (a rank starts its next call when it
    is done with this one, not when the slowest is), orders each rank's
    chunks: ``I`` (or ``B``) first whenever ready (deepest chunk first: the
    critical path), then a forward (deepest chunk first), then the oldest
    deferred ``W``, which thus fills what would be idle time. A chunk's ``W``
    runs before that chunk's next ``I``, so a backward always meets the steps
    of every earlier backward of its chunk (weight prediction counts them
    exactly), and a ``W`` that completes a step runs before the chunk's next
    forward (deferring it would only feed that forward older weights; a ``W``
    that only accumulates can wait). A chunk stops, as the one-chunk stream does, once its forwards
    are done and the rule would allow a forward again; the rank's deferred
    ``W`` close its call.

    Args:
        ranks, v: ranks and chunks per rank.
        split: ``I`` then ``W`` for each backward, else ``B``.

    Example::

        layout = AsyncLayout(2, 2, split=True)
        first = layout.call(4, step_every=1)  # per rank, its compute actions of call 1
        second = layout.call(8, step_every=1)  # micro-batches 4..7 enqueued
        rest = layout.call(8, step_every=1, flush=True)
    """

    def __init__(self, ranks: int, v: int, split: bool = False) -> None:
        self.p, self.v, self.n = ranks, v, ranks * v
        self.split = split
        self.f = [0] * self.n  # forwards done, per virtual stage
        self.b = [0] * self.n  # backwards (B or I) done
        self.depth = [self.n - 1 - s for s in range(self.n)]
        self.mine = [sorted(range(r, self.n, ranks), reverse=True) for r in range(ranks)]
        self.done: dict[tuple[str, int, int], int] = {}  # ("F"|"B", s, j) -> end time
        self.busy = [0] * ranks

    def counts(self) -> list[tuple[int, int]]:
        """Per virtual stage, ``(forwards, backwards)`` done."""
        return list(zip(self.f, self.b, strict=True))

    def _ready(self, kind: str, s: int, j: int, t: int) -> bool:
        count = self.f[s] if kind == "F" else self.b[s]
        return j < count and self.done.get((kind, s, j), 0) <= t

    def _finished(self, s: int, total: int, flush: bool) -> bool:
        f, b = self.f[s], self.b[s]
        return b == f if flush else f == total and f - b <= self.depth[s]

    def call(self, total: int, step_every: int = 0, flush: bool = False) -> list[list[Action]]:
        """Per rank, its compute actions of the call that brings ``total`` micro-batches
        enqueued (``flush``: only the backwards still owed, and a last partial step).

        Args:
            step_every: a ``STEP`` (``stage`` = the chunk's virtual stage, ``mb``
                = its backwards done) after every ``step_every``-th backward of
                a chunk; 0: none.

        Raises:
            PipelineError: internal: the layout did not finish.
        """
        p, n, f, b = self.p, self.n, self.f, self.b
        pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        lists: list[list[Action]] = [[] for _ in range(p)]
        over = [False] * p
        t = min(self.busy)
        limit = t + 4 * n * (total + 1) + 8
        while not all(over):
            for r in range(p):
                if over[r] or self.busy[r] > t:
                    continue
                act = self._choose(r, t, total, flush, pending[r], step_every)
                if act is None:
                    if not pending[r] and all(
                        self._finished(s, total, flush) for s in self.mine[r]
                    ):
                        over[r] = True
                    continue
                lists[r].append(act)
                self.busy[r] = t + 1
                if act.kind == "F":
                    f[act.stage] += 1
                    self.done[("F", act.stage, act.mb)] = t + 1
                elif act.kind in ("I", "B"):
                    b[act.stage] += 1
                    self.done[("B", act.stage, act.mb)] = t + 1
                    if act.kind == "I":
                        pending[r].append((act.stage, act.mb))
                every = step_every
                if act.kind in ("B", "W") and every and (act.mb + 1) % every == 0:
                    lists[r].append(Action("STEP", act.mb + 1, act.stage))
            t += 1
            if t > limit:
                raise PipelineError(f"internal: the asynchronous layout stopped at {self.counts()}")
        if flush and step_every:
            for r in range(p):  # a last partial accumulation
                for s in reversed(self.mine[r]):
                    if f[s] % step_every:
                        lists[r].append(Action("STEP", f[s], s))
        # What later calls still read: backwards from the oldest one owed on.
        oldest = min(b)
        self.done = {k: e for k, e in self.done.items() if k[2] >= oldest}
        return lists

    def _choose(
        self,
        r: int,
        t: int,
        total: int,
        flush: bool,
        pending: list[tuple[int, int]],
        step_every: int,
    ) -> Action | None:
        n, f, b = self.n, self.f, self.b
        for s in self.mine[r]:
            j = b[s]
            if self._finished(s, total, flush) or j >= f[s] or not self._ready("F", s, j, t):
                continue
            if s < n - 1 and not self._ready("B", s + 1, j, t):
                continue
            owed = [w for w in pending if w[0] == s]
            if owed:  # this chunk's last W first: its step comes before this backward
                pending.remove(owed[0])
                return Action("W", owed[0][1], s)
            return Action("I" if self.split else "B", j, s)
        if not flush:
            for s in self.mine[r]:
                j = f[s]
                if (
                    j < total
                    and j - b[s] <= self.depth[s]
                    and (s == 0 or self._ready("F", s - 1, j, t))
                ):
                    # A W that completes a step goes before the chunk's next
                    # forward: deferring it would feed that forward older weights.
                    owed = [w for w in pending if w[0] == s]
                    if owed and step_every and (owed[0][1] + 1) % step_every == 0:
                        pending.remove(owed[0])
                        return Action("W", owed[0][1], s)
                    return Action("F", j, s)
        if pending:
            s, j = pending.pop(0)
            return Action("W", j, s)
        return None


def flush_ops(done_fwds: int, done_bwds: int) -> list[Op]:
    """The backwards an asynchronous stage still owes."""
    return [("B", j) for j in range(done_bwds, done_fwds)]
