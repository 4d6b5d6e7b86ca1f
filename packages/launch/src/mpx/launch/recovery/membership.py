"""Who trains the next step: the lighthouse's membership and commit rules (pure Python).

Replica groups (``mpxrun --replica-groups R``) train one model in data
parallel across groups over TCP; :class:`Membership` decides, step by step,
which groups take part (a *quorum*) and whether a step they took part in is
applied (*committed*). The server around it is :mod:`mpx.launch.recovery.lighthouse`;
the trainers' side is ``mpx.dataparallel.FaultTolerantOptimizer``.

The rules, so that no step is ever applied by some replicas and not others:

- A group is alive from its first ``hello`` until one of its ranks' connections
  closes (dead), it leaves at its end, or a rank stays silent past the group's
  *deadline* (counted out). A group that comes back (a restart) is a new
  *incarnation*: the old one is dead from then on.
- The deadline is ``heartbeat_timeout`` stretched by the group's own recent
  timing: :data:`BEAT_SLACK` times the longest of its ranks' recent gaps between
  beats, :data:`STEP_SLACK` times its longest recent step (the time between its
  quorum requests). A loaded machine spreads the beats of a live group; a hung
  one stops beating at once. A group counted out is out of the quorums but not
  dead: its next beats (every rank's) bring it back, and it rejoins at the next
  boundary as a restarted group would, loading the state it missed. Only one
  silent for ``hang_timeout`` is *hung*: ``mpxrun`` stops and restarts it.
- Before each step every group's rank 0 asks for a quorum, saying its step.
  The first quorum waits for ``expected`` groups (or ``join_timeout``); each
  later one forms once every live member of the previous quorum has asked,
  and takes in every group that has asked by then (a newcomer is admitted at
  a step boundary, never in the middle of a step).
- The quorum's step is the largest any group asked with. The groups at that
  step are its *members*: they train it. A group behind it (a restart, a
  group counted out and back) *joins*: it is told a *donor*, a member, whose
  state of the step's start it receives while the members compute, then
  the step's averaged gradients; it takes no part in them, and applies the
  step with the members if it commits (one survivor step to rejoin, not a
  joint step of its own after the state). At the first quorum every group is
  a member, and every one but the lowest loads the lowest's state first.
- After its step's reduction each member votes ok or not. The step commits iff
  every member votes ok; it aborts as soon as one votes not ok or dies before
  voting. Every member gets the same outcome, so a step is applied by all
  the quorum's members or by none (a member dead after voting ok does not
  undo a commit: its replacement recovers from a peer). A joining group's
  vote (did it get the state and the gradients) decides only whether it
  applies the step too, and its death aborts nothing.
- Never back to fresh weights: when every group that held the newest
  committed state is gone, the next quorum waits for every group to ask (or
  ``join_timeout``; not while a counted-out group may come back with it).
  Its step is then the largest any group asked with: a group that resumed from
  a checkpoint says so by asking past step 0, and the others load its state. If
  every group asks at step 0 the state is lost (:attr:`Membership.state_lost`):
  no quorum forms and the job ends, saying so, rather than training again from
  fresh weights.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

__all__ = ["BEAT_SLACK", "RECENT", "STEP_SLACK", "Membership", "Quorum"]

#: how many of a rank's recent beat gaps (and a group's recent steps) its deadline reads
RECENT = 16
#: the deadline is at least this many times a rank's longest recent gap between beats
BEAT_SLACK = 4.0
#: and at least this many times the group's longest recent step
STEP_SLACK = 2.0


@dataclass
class Quorum:
    """One step's membership and its outcome.

    Attributes:
        id: increasing from 1.
        step: the step every member takes (the largest any member asked with).
        members: the groups that train the step, sorted.
        incarnations: each member's and joining group's incarnation.
        addresses: their ranks' peer addresses (``[host, port]`` per rank).
        donors: group behind ``step`` -> the member it loads its state from.
        joining: the groups that receive the step rather than train it (see the
            module's rules), sorted.
        votes: the members and joining groups that voted, and how.
        outcome: None while undecided, True committed, False aborted.
    """

    id: int
    step: int
    members: list[int]
    incarnations: dict[int, str]
    addresses: dict[int, list[list[object]]]
    donors: dict[int, int]
    joining: list[int] = field(default_factory=list)
    votes: dict[int, bool] = field(default_factory=dict)
    outcome: bool | None = None

    def view(self, group: int) -> dict[str, object]:
        """What ``group`` is told of this quorum (JSON-ready)."""
        return {
            "quorum": self.id,
            "step": self.step,
            "members": self.members,
            "joining": self.joining,
            "incarnations": {str(g): i for g, i in self.incarnations.items()},
            "addresses": {str(g): a for g, a in self.addresses.items()},
            "donor": self.donors.get(group),
            "recipients": sorted(g for g, d in self.donors.items() if d == group),
        }


@dataclass
class _Group:
    incarnation: str
    size: int
    addresses: dict[int, list[object]] = field(default_factory=dict)
    beats: dict[int, float] = field(default_factory=dict)
    alive: bool = True
    finished_step: int | None = None
    # Silent past its deadline with its connections open: out of the quorums until
    # its beats come back (alive again), its connections close or it is hung.
    counted_out: bool = False
    gaps: dict[int, deque[float]] = field(default_factory=dict)
    steps: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    asked_at: float | None = None

    def deadline(self, heartbeat_timeout: float, hang_timeout: float) -> float:
        """Seconds a rank may stay silent: see the module's rules."""
        gap = max((max(g) for g in self.gaps.values() if g), default=0.0)
        step = max(self.steps, default=0.0)
        return min(max(heartbeat_timeout, BEAT_SLACK * gap, STEP_SLACK * step), hang_timeout)

    def silent(self, now: float) -> float:
        """The longest any rank has been silent."""
        return max((now - t for t in self.beats.values()), default=0.0)


class Membership:
    """The lighthouse's state: live groups, the quorums, the votes.

    Not thread-safe: :mod:`mpx.launch.recovery.lighthouse` calls it under one lock.
    Every method takes the time as an argument (tests drive the clock).
    ``hang_timeout`` (default the larger of 30 s and 20 heartbeat timeouts): how
    long a counted-out group may stay silent before it is hung (:meth:`hung`).

    Example::

        m = Membership(expected=2, join_timeout=30.0, heartbeat_timeout=0.5, now=0.0)
        m.hello(0, 0, 1, "a", ["127.0.0.1", 5000], now=0.0)
        m.hello(1, 0, 1, "b", ["127.0.0.1", 5001], now=0.0)
        m.request(0, "a", 0); m.request(1, "b", 0)
        q = m.form(now=0.1)          # members [0, 1], step 0
        m.vote(0, "a", q.id, True); m.vote(1, "b", q.id, True)
        assert q.outcome is True
    """

    def __init__(
        self,
        expected: int,
        join_timeout: float,
        heartbeat_timeout: float,
        now: float,
        hang_timeout: float | None = None,
    ) -> None:
        self.expected = expected
        self.join_timeout = join_timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.hang_timeout = (
            hang_timeout if hang_timeout is not None else max(30.0, 20 * heartbeat_timeout)
        )
        self.started = now
        # The step after the newest commit: what a member must be at to hold the state.
        self.committed = 0
        # That step, once every group asked at step 0 with no one holding it (see form).
        self.state_lost: int | None = None
        # (step resumed at, step lost back to) of the last quorum that went back.
        self.went_back: tuple[int, int] | None = None
        self._short_since: float | None = None
        self.groups: dict[int, _Group] = {}
        self.pending: dict[int, int] = {}
        self.assigned: dict[int, int] = {}
        self.quorums: dict[int, Quorum] = {}
        self.last: Quorum | None = None
        self.last_aborted = 0
        # (quorum id, step, members, outcome) of every quorum formed, for logs and tests.
        self.history: list[tuple[int, int, list[int], bool | None]] = []

    # -- liveness --

    def _current(self, group: int, incarnation: str) -> _Group | None:
        found = self.groups.get(group)
        if found is None or found.incarnation != incarnation or not found.alive:
            return None
        return found

    def hello(
        self, group: int, rank: int, size: int, incarnation: str, address: list[object], now: float
    ) -> None:
        """Rank ``rank`` of ``size`` of ``group`` (this incarnation) is up at ``address``."""
        found = self.groups.get(group)
        if found is None or found.incarnation != incarnation:
            if found is not None and (found.alive or found.counted_out):
                self._kill(group)  # restarted while its old self was thought alive
            found = self.groups[group] = _Group(incarnation, size)
        found.addresses[rank] = address
        found.beats[rank] = now

    def beat(self, group: int, rank: int, incarnation: str, now: float) -> bool:
        """A heartbeat; False if this incarnation is no longer a member (dead or replaced,
        or counted out and some rank still silent: see :meth:`back`)."""
        found = self.groups.get(group)
        if found is None or found.incarnation != incarnation:
            return False
        if not (found.alive or found.counted_out):
            return False
        last = found.beats.get(rank)
        if last is not None:
            found.gaps.setdefault(rank, deque(maxlen=RECENT)).append(now - last)
        found.beats[rank] = now
        return found.alive or self.back(group, now)

    def back(self, group: int, now: float) -> bool:
        """A counted-out group whose every rank beat within its deadline is alive again
        (it asks to rejoin, and is admitted as a restarted group is); True if it is."""
        found = self.groups[group]
        if found.counted_out and found.silent(now) <= self.deadline(group):
            found.counted_out = False
            found.alive = True
        return found.alive

    def counted_out(self, group: int, incarnation: str) -> bool:
        """Whether this incarnation is counted out, and may come back (see :meth:`back`)."""
        found = self.groups.get(group)
        return found is not None and found.incarnation == incarnation and found.counted_out

    def deadline(self, group: int) -> float:
        """Seconds a rank of ``group`` may stay silent before it is counted out."""
        return self.groups[group].deadline(self.heartbeat_timeout, self.hang_timeout)

    def lost(self, group: int, incarnation: str) -> None:
        """A connection of this incarnation closed: it is dead (unless it had left)."""
        found = self.groups.get(group)
        if found is not None and found.incarnation == incarnation:
            if found.alive:
                self._kill(group)
            found.counted_out = False

    def expire(self, now: float) -> list[int]:
        """Counts out the groups with a rank silent past their deadline; returns them."""
        silent = [
            g
            for g, found in self.groups.items()
            if found.alive and found.silent(now) > self.deadline(g)
        ]
        for group in silent:
            self._kill(group)
            self.groups[group].counted_out = True
        return silent

    def hung(self, now: float) -> list[int]:
        """The counted-out groups silent for ``hang_timeout``: dead from now on (``mpxrun``
        stops and restarts them); returns them."""
        hung = [
            g
            for g, found in self.groups.items()
            if found.counted_out and found.silent(now) > self.hang_timeout
        ]
        for group in hung:
            self.groups[group].counted_out = False
        return hung

    def leave(self, group: int, incarnation: str, step: int) -> None:
        """The group ended its training at ``step``: no longer a member, not a failure."""
        found = self.groups.get(group)
        if found is not None and found.incarnation == incarnation:
            if found.alive:
                self._kill(group)
            found.counted_out = False
            found.finished_step = step

    def alive(self) -> dict[int, str]:
        """The live groups and their incarnations: a group counts from its last rank's
        hello (its rank 0 asks for a quorum only then: a peer that waits for a
        restarted group to come back then finds it asking a moment later, not its
        other ranks still starting for seconds)."""
        return {
            g: found.incarnation
            for g, found in self.groups.items()
            if found.alive and len(found.addresses) >= found.size
        }

    def _kill(self, group: int) -> None:
        self.groups[group].alive = False
        self.pending.pop(group, None)
        self.assigned.pop(group, None)
        for quorum in self.quorums.values():
            if quorum.outcome is None and group in quorum.members and group not in quorum.votes:
                self._decide(quorum, False)

    # -- quorums --

    def finished(self, group: int, step: int) -> int | None:
        """The step the others ended training at, if ``group`` (at ``step``) came back after
        every other group had left: there is no state to rejoin (None: there is)."""
        others = [g for g in self.alive() if g != group]
        ends = [f.finished_step for f in self.groups.values() if f.finished_step is not None]
        if others or not ends or max(ends) <= step:
            return None
        return max(ends)

    def request(self, group: int, incarnation: str, step: int, now: float | None = None) -> bool:
        """The group asks to take part in the next step, being at ``step``; False if dead
        or counted out. ``now``: its steps' times stretch its deadline."""
        found = self._current(group, incarnation)
        if found is None:
            return False
        if now is not None:
            if found.asked_at is not None:
                found.steps.append(now - found.asked_at)
            found.asked_at = now
        self.pending[group] = step
        self.assigned.pop(group, None)
        return True

    def form(self, now: float) -> Quorum | None:
        """Forms the next quorum if its time has come (see the module's rules)."""
        if not self.pending:
            return None
        if self.last is None:
            if len(self.pending) < self.expected and now - self.started < self.join_timeout:
                return None
        else:
            live = self.alive()
            taking_part = [*self.last.members, *self.last.joining]
            if any(g in live and g not in self.pending for g in taking_part):
                return None
            if self.last.outcome is None:
                return None  # a member asking again before the outcome: wait for it
        step = max(self.pending.values())
        if self.last is not None and step < self.committed:
            # No asking member holds the newest committed state: wait for every group
            # (one may have resumed from a checkpoint) unless one counted out may
            # come back with it; then go on from the newest state there is, never
            # from fresh weights (see the module's rules).
            if any(found.counted_out for found in self.groups.values()):
                return None
            if self._short_since is None:
                self._short_since = now
            if len(self.pending) < self.expected and now - self._short_since < self.join_timeout:
                return None
            if step == 0:
                self.state_lost = self.committed
                return None
            self.went_back = (step, self.committed)
            self.committed = step
        self._short_since = None
        asking = sorted(self.pending)
        ahead = [g for g in asking if self.pending[g] == step]
        behind = [g for g in asking if self.pending[g] < step]
        members, joining = ahead, behind
        if self.last is None:
            # The first step starts every group from the lowest one's state
            # (weights, optimizer, data position): replicas that were seeded
            # differently still train one model.
            ahead, behind = ahead[:1], [g for g in asking if g != ahead[0]]
            members, joining = asking, []
        donors = {g: ahead[i % len(ahead)] for i, g in enumerate(behind)}
        quorum = Quorum(
            id=(self.last.id + 1) if self.last else 1,
            step=step,
            members=members,
            incarnations={g: self.groups[g].incarnation for g in asking},
            addresses={
                g: [self.groups[g].addresses[r] for r in sorted(self.groups[g].addresses)]
                for g in asking
            },
            donors=donors,
            joining=joining,
        )
        self.quorums[quorum.id] = quorum
        # Keep the recent ones only: a vote is for the quorum just formed.
        for old in [q for q in self.quorums if q < quorum.id - 8]:
            del self.quorums[old]
        self.last = quorum
        self.pending.clear()
        for g in asking:
            self.assigned[g] = quorum.id
        self.history.append((quorum.id, step, members, None))
        return quorum

    def vote(self, group: int, incarnation: str, quorum_id: int, ok: bool) -> bool | None:
        """Records a member's vote; returns the outcome so far (None: undecided)."""
        quorum = self.quorums.get(quorum_id)
        if quorum is None:
            return False
        if quorum.incarnations.get(group) != incarnation:
            return False  # not this incarnation's quorum: nothing it may commit
        if quorum.outcome is None:
            quorum.votes[group] = ok
            if group in quorum.joining:
                pass  # whether it applies the step: the members' votes decide the step
            elif not ok:
                self._decide(quorum, False)
            elif all(quorum.votes.get(g) for g in quorum.members):
                self._decide(quorum, True)
        return quorum.outcome

    def outcome(self, quorum_id: int) -> bool | None:
        quorum = self.quorums.get(quorum_id)
        return False if quorum is None else quorum.outcome

    def _decide(self, quorum: Quorum, outcome: bool) -> None:
        quorum.outcome = outcome
        if outcome:
            self.committed = quorum.step + 1
        else:
            self.last_aborted = max(self.last_aborted, quorum.id)
        i, step, members, _ = self.history[quorum.id - 1]
        self.history[quorum.id - 1] = (i, step, members, outcome)
