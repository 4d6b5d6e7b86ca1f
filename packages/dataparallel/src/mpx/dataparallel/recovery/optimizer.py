"""Data parallelism across replica groups that survives a group's death.

:class:`FaultTolerantOptimizer`:

Under ``mpxrun --replica-groups R -n N`` each group is its own MPI world;
this optimizer averages rank ``r``'s gradients over rank ``r`` of every live
group (through shared memory on one host, :mod:`mpx.dataparallel.recovery.shm`, else
over TCP, :mod:`mpx.dataparallel.recovery.links`) and steps only when the
lighthouse (:mod:`mpx.launch.recovery.lighthouse`) commits the step, that is when every
group of the step's membership has its gradients published (or, over TCP,
exchanged); the sum follows the commit. A step during which a
group dies is discarded by every survivor (no partial update) and done again
by the survivors alone; a restarted group joins the next step: it receives a
peer's live weights, optimizer state, step count and the loop's data position
while the survivors train that step, then the step's averaged gradients, and
applies it with them (see begin_step). See docs/live-recovery.md.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import uuid
from collections.abc import MutableMapping
from typing import Any

import torch
from mpi4py import MPI
from torch import nn

from mpx.dataparallel.errors import (
    DataParallelError,
    DataParallelMismatchError,
    DataParallelTypeError,
    DataParallelValueError,
)
from mpx.dataparallel.recovery.catching_up import StateTransfer
from mpx.dataparallel.recovery.gradients import GradientExchange
from mpx.dataparallel.recovery.lighthouse_client import LighthouseClient, describe_gradients
from mpx.dataparallel.recovery.links import (
    PeerLinks,
    PeerLost,
)
from mpx.dataparallel.synchronous import DistributedOptimizer
from mpx.launch import JobKey, address_towards

__all__ = ["FaultTolerantOptimizer", "TrainingFinished"]

# The keys of a quorum request's reply (see mpx.launch.recovery.lighthouse): a vote's reply
# that has one of them carries the next step's quorum.
_ANSWERS = frozenset({"quorum", "member", "finished", "lost"})


class TrainingFinished(SystemExit):
    """Raised by :meth:`FaultTolerantOptimizer.zero_grad` in a group that came back after
    every other group had ended training and left: there is nothing left to train.

    A ``SystemExit`` with code 0: uncaught, the group's processes end quietly (no
    traceback; rank 0 prints one line) and ``mpxrun`` counts the job as finished.
    ``step`` is the step the others ended at.

    Example::

        try:
            ft.zero_grad()
        except dp.TrainingFinished as done:
            print(f"the others finished at step {done.step}")
    """

    def __init__(self, step: int) -> None:
        super().__init__(0)
        self.step = step


def _setting(name: str) -> str | None:
    # Set by mpxrun --replica-groups for each group's job (mpx.launch.settings declares
    # them): read as they are now, not cached, since one process may see several jobs'.
    return os.environ.get(name)  # noqa: TID251


class FaultTolerantOptimizer:
    """Wraps ``optimizer`` to average gradients across replica groups and step only on commit.

    Use it as :class:`DistributedOptimizer` is used: ``zero_grad()`` (which starts
    the step: the membership, and for a restarted group the peer's state),
    forward, backward, ``step()``, which returns True if the step committed and
    the weights changed, False if it was discarded (a group died during it; do
    the same step again: ``step_count`` did not move).

    Args:
        optimizer: the wrapped optimizer over ``model``'s parameters.
        model: the module whose parameters' gradients are averaged and whose
            ``state_dict`` a restarted peer receives.
        state: a dict the training loop keeps its data position in (epoch,
            index...); a restarted group's is replaced, in place, by its donor's.
        lighthouse: ``host:port``; default ``MPX_LIGHTHOUSE`` (set by mpxrun).
        group: this process's replica group; default ``MPX_REPLICA_GROUP``.
        comm: the group's MPI communicator (default the world: a group is an MPI
            world of its own); its ranks agree on every step's outcome.

    ``optimizer`` may be a :class:`DistributedOptimizer` over the group's ranks (data
    parallel inside the group as well): ``step()`` then averages over the group
    first, then each rank over its column, and steps the optimizer it wraps.
        host: the address this rank's peers reach it at; default the address this
            host reaches the lighthouse from (127.0.0.1 for a local job).
        compression: None, or an ``mpx.quantize.CompressionConfig``: the gradients
            between groups that cannot share memory (other hosts) travel quantized to
            its ``bits`` in buckets of ``bucket_size``, and every member sums the same
            values (:mod:`~mpx.dataparallel.recovery.gradients`; needs mpx-quantize).

    Raises:
        DataParallelTypeError: ``optimizer`` is not a ``torch.optim.Optimizer``,
            ``model`` not an ``nn.Module``, or ``state`` not a dict.
        DataParallelValueError: no lighthouse (not under ``mpxrun --replica-groups``),
            or parameters of more than one dtype.
        DataParallelMismatchError: on every rank of a group whose gradients (their
            number of elements, dtype, or ``compression``) differ from another group's
            at the same rank: they could never be averaged together.

    Example::

        ft = FaultTolerantOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model,
                                    state={"epoch": 0})
        while ft.step_count < steps:
            ft.zero_grad()                       # may load a peer's state
            loss_fn(model(batch(ft.step_count, ft.members))).backward()
            ft.step()                            # False: discarded, redo this step
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        state: MutableMapping[str, Any] | None = None,
        *,
        lighthouse: str | None = None,
        group: int | None = None,
        comm: Any = None,
        host: str | None = None,
        compression: Any = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DataParallelTypeError(
                f"FaultTolerantOptimizer: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}; pass e.g. torch.optim.SGD(model.parameters())"
            )
        if not isinstance(model, nn.Module):
            raise DataParallelTypeError(
                f"FaultTolerantOptimizer: model must be an nn.Module, got {type(model).__name__}"
            )
        if state is not None and not isinstance(state, MutableMapping):
            raise DataParallelTypeError(
                f"FaultTolerantOptimizer: state must be a dict (the loop's data position), got "
                f"{type(state).__name__}"
            )
        address = lighthouse if lighthouse is not None else _setting("MPX_LIGHTHOUSE")
        if not address or ":" not in address:
            raise DataParallelValueError(
                f"FaultTolerantOptimizer: lighthouse={address!r} is not host:port; run under "
                "mpxrun --replica-groups R (it sets MPX_LIGHTHOUSE) or pass lighthouse="
            )
        self.group = int(group if group is not None else _setting("MPX_REPLICA_GROUP") or 0)
        self.optimizer = optimizer
        # Data parallel inside the group too: its reduction runs first, in step().
        self._group_dp = optimizer if isinstance(optimizer, DistributedOptimizer) else None
        self.model = model
        self.state: MutableMapping[str, Any] = state if state is not None else {}
        self._params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise DataParallelValueError(
                "FaultTolerantOptimizer: the model's parameters have dtypes "
                f"{sorted(map(str, dtypes))}; this first version averages one dtype: cast "
                "the model to one"
            )
        dtype = dtypes.pop() if dtypes else torch.float32
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        # One per start of the whole group: its ranks are one member to the lighthouse.
        self.incarnation = uuid.uuid4().hex
        if self.size > 1:
            self.incarnation = self.comm.bcast(self.incarnation, root=0)
        groups = int(_setting("MPX_REPLICA_GROUPS") or 0)
        if not 0 <= self.group < groups:
            raise DataParallelValueError(
                f"FaultTolerantOptimizer: group {self.group} is not one of the "
                f"MPX_REPLICA_GROUPS={groups} groups; run under mpxrun --replica-groups R"
            )
        # Every connection proves the job's secret (mpx.launch.handshake), both ways.
        key = JobKey.from_environment()
        here = host or address_towards(address.rpartition(":")[0])  # where peers reach it
        self._links = PeerLinks(self.group, key, groups, here)
        gradients = describe_gradients(sum(p.numel() for p in self._params), dtype, compression)
        refused: str | None = None
        try:
            self._client = LighthouseClient(
                address,
                self.group,
                self.rank,
                self.size,
                self.incarnation,
                self._links.address,
                key,
                gradients,
            )
        except DataParallelMismatchError as error:
            refused = str(error)
        # Also waits until every rank said hello, before rank 0 asks for a quorum.
        refusals = self.comm.allgather(refused) if self.size > 1 else [refused]
        if any(r is not None for r in refusals):
            # Every rank of the group raises, not only those the lighthouse refused
            # (the others would wait for them, the group half a member).
            if refused is None:
                self._client.close()
            self._links.close()
            first = next(r for r in refusals if r is not None)
            raise DataParallelMismatchError(refused if refused is not None else first)
        self.step_count = 0
        self.members: list[int] = []
        self.quorum_id = 0
        self.recovered = False
        self._quorum: dict[str, Any] | None = None
        # The next step's quorum, when the lighthouse sent it with the last vote's outcome.
        self._ahead: dict[str, Any] | None = None
        # The gradients' buffers, their exchange and their sum (see gradients).
        self._grads = GradientExchange(self._params, dtype, self.group, groups, compression)
        # The state sent to a group behind the step, or received from its donor.
        self._transfer = StateTransfer(model, self.optimizer, self.state, self._grads.nbytes)
        # A step joined (see _join): the groups this rank gave their state to, which
        # get the loop's state after it; the donor this group got it from.
        self._gave: dict[int, str] = {}
        self._joined_from: tuple[int, str] | None = None
        self._closed = False
        atexit.register(self.close)

    def live_groups(self) -> list[int]:
        """The groups alive now, as the lighthouse's last heartbeat reply said (a group
        restarting is listed once it has built its optimizer, before it takes part)."""
        return sorted(self._client.alive)

    # -- the step --

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Starts the step (see :meth:`begin_step`) and clears the gradients."""
        self.begin_step()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def begin_step(self) -> None:
        """Joins the next step's membership; a group behind it first catches up.

        A group behind the members' step (a restart) receives a member's state and
        that step's averaged gradients while the members train it, applies the step
        with them, then gets the loop's state after it (:meth:`_join`): it returns
        one step later than the donor's state, a member of the next step, with
        ``recovered`` True. Called by :meth:`zero_grad`; call it yourself before the
        forward if you clear gradients another way. Does nothing if the step has begun.
        """
        self.recovered = False
        while self._quorum is None:
            reply, self._ahead = self._ahead, None
            if reply is None:
                reply = (
                    self._client.request({"op": "quorum", "step": self.step_count})
                    if (self.rank == 0)
                    else None
                )
                if self.size > 1:
                    reply = self.comm.bcast(reply, root=0)
            assert reply is not None
            if "finished" in reply:
                if self.rank == 0:
                    print(
                        f"mpx: live recovery: group {self.group} came back at step "
                        f"{self.step_count} after the other groups ended training at step "
                        f"{reply['finished']}: nothing left to train, it stops here",
                        file=sys.stderr,
                        flush=True,
                    )
                raise TrainingFinished(int(reply["finished"]))
            if "lost" in reply:
                raise DataParallelError(
                    f"FaultTolerantOptimizer: no group holds the state of step {reply['lost']} "
                    "(every group that had it is gone) and none resumed from a checkpoint: "
                    f"group {self.group} would train again from fresh weights at step "
                    f"{self.step_count}. Save checkpoints as you train and, at a restart, load "
                    "the newest and set ft.step_count to its step before the first zero_grad() "
                    "(docs/live-recovery.md, 'Checkpoints')"
                )
            if "quorum" not in reply:
                raise DataParallelError(
                    f"FaultTolerantOptimizer: the lighthouse counted group {self.group} out for "
                    "good (silent past MPX_FT_HANG_TIMEOUT, or replaced by a restart of its "
                    "group); the group must restart to rejoin"
                )
            quorum = reply["quorum"]
            self.quorum_id = int(quorum["quorum"])
            self._links.keep(
                {(int(g), i) for g, i in quorum["incarnations"].items() if int(g) != self.group}
            )
            ok = True
            loaded: dict[str, Any] | None = None
            self._send_loop(quorum)
            joined = self._joined_from is not None
            try:
                if joined:
                    self._receive_loop(quorum)
            except PeerLost:
                ok = False
            if quorum["recipients"]:
                self._send_state(quorum)
            try:
                if quorum["donor"] is not None:
                    loaded = self._receive_state(quorum)
            except PeerLost:
                ok = False
            if self.size > 1:
                # Each rank receives its own column's state: the group loads it only if
                # every rank got its part (a half-loaded group would ask with one rank's step).
                ok = bool(self.comm.allreduce(ok, op=MPI.LAND))
            if ok and loaded is not None:
                self.step_count = self._transfer.load(loaded)
                self.recovered = True
            if not ok:
                if joined:
                    # The step it joined is applied, the loop's state after it is not
                    # here: behind again, to load a whole state (step 0 says "nothing":
                    # were every member gone, this group holds no step's state).
                    self.step_count = 0
                self._vote(quorum, False)  # the step cannot go on: redo the membership
            elif self.group in quorum.get("joining", ()):
                self._join(quorum)  # then the next quorum, from its vote's reply
            else:
                self._quorum = quorum
                self.members = [int(g) for g in quorum["members"]]

    def step(self) -> bool:
        """Averages the gradients over the live groups; steps if the step commits.

        A CPU parameter's ``grad`` is then a view of a buffer the next step
        reuses (as :class:`DistributedOptimizer` does): clone it to keep it.

        Returns:
            True if committed (the optimizer stepped, ``step_count`` grew by 1);
            False if discarded (the gradients are stale: do this step again).
        """
        stale = False
        if self._quorum is None:
            self.begin_step()
            # Loaded just now: the gradients were computed from the old state.
            stale = self.recovered
        quorum = self._quorum
        assert quorum is not None
        if stale:
            return self._finish(quorum, False)
        ok = True
        if self._group_dp is not None:
            # The group's own average first (collective over the group; a dead rank
            # kills the whole group), so the columns exchange group means.
            self._group_dp._finish()
        try:
            self._transfer.await_sending()
            self._reduce(quorum)
        except PeerLost:
            ok = False
            self._grads.discard()
            # Closed now, not after the vote: peers still waiting for this rank's
            # gradients see the end of the step at once.
            self._links.drop(int(quorum["quorum"]))
        return self._finish(quorum, ok)

    def _join(self, quorum: dict[str, Any]) -> None:
        """A joining group's step, its donor's state loaded: the members' gradients, none
        of its own, applied if the step commits; the loop's state follows (_receive_loop)."""
        members = [int(g) for g in quorum["members"]]
        ok = True
        try:
            links = {g: self._link(quorum, g) for g in members}
            check = lambda: self._check(quorum)  # noqa: E731
            self._grads.receive(members, int(quorum["quorum"]), links, check)
        except PeerLost:
            ok = False
        if self.size > 1:
            ok = bool(self.comm.allreduce(ok, op=MPI.LAND))
        committed = self._vote(quorum, ok) and ok
        if committed:
            self._grads.average()
            donor = str(quorum["donor"])
            self._joined_from = (int(donor), str(quorum["incarnations"][donor]))
        self._grads.discard()
        self._apply(committed)

    def _finish(self, quorum: dict[str, Any], ok: bool) -> bool:
        try:
            # Sent before the optimizer steps: the state on the wire is this step's.
            self._transfer.await_sending()
        except PeerLost:
            ok = False
        committed = self._vote(quorum, ok)
        if committed:
            self._grads.average()
        self._grads.discard()
        # Those it gave a state to that joined a committed step get the loop's next.
        joined = set(quorum.get("joining", ())) if committed else set()
        self._gave = {
            g: str(quorum["incarnations"][str(g)]) for g in quorum["recipients"] if g in joined
        }
        self._apply(committed)
        self._quorum = None
        return committed

    def _apply(self, committed: bool) -> None:
        """Steps the optimizer if ``committed`` (the averaged gradients are in place)."""
        inner = self._group_dp
        if inner is None:
            if committed:
                self.optimizer.step()
        elif committed:
            # Reduced already: step the optimizer it wraps, not its step() (a second reduction).
            if inner._compare_parameters:
                inner._compare_parameters = False
                inner._check_parameters_agree()
            inner.optimizer.step()
            inner._reset()
        else:
            inner.zero_grad()  # completes a reduction in flight (collective), starts over
        if committed:
            self.step_count += 1

    def _vote(self, quorum: dict[str, Any], ok: bool) -> bool:
        if self.size > 1:
            ok = bool(self.comm.allreduce(ok, op=MPI.LAND))
        reply = None
        if self.rank == 0:
            # "next": the lighthouse answers with the next step's quorum as well,
            # formed once every member voted (the vote asks for it, at this
            # group's step, + 1 if the step commits; a group whose join failed is
            # still at its old step): one round trip and one wait for the slowest
            # group a step, not two.
            reply = self._client.request(
                {"op": "vote", "quorum": quorum["quorum"], "ok": ok, "next": self.step_count}
            )
        if self.size > 1:
            reply = self.comm.bcast(reply, root=0)
        assert reply is not None
        outcome = bool(reply["outcome"])
        if _ANSWERS.intersection(reply):
            self._ahead = reply  # begin_step's reply, received already
        if not outcome:
            self._links.drop(int(quorum["quorum"]))
        return bool(outcome)

    # -- the wire --

    def _check(self, quorum: dict[str, Any]) -> None:
        client = self._client
        if client.lost_at is not None:
            raise PeerLost("the lighthouse stopped answering")
        if client.last_aborted >= int(quorum["quorum"]):
            raise PeerLost(f"quorum {quorum['quorum']} was aborted")
        self._check_alive(quorum, quorum["members"])

    def _check_alive(self, quorum: dict[str, Any], groups: Any) -> None:
        for g in groups:
            # Another incarnation: it restarted. Absent: either the last heartbeat's
            # reply predates its hello (a discarded first step on a loaded machine,
            # session 17), or it died, and then the lighthouse aborted this quorum
            # in the same breath (last_aborted, above) unless it had voted already
            # (a joining group's death aborts nothing: its own check says it).
            incarnation = quorum["incarnations"][str(g)]
            seen = self._client.alive.get(int(g), incarnation)
            if int(g) != self.group and seen != incarnation:
                raise PeerLost(f"group {g} is no longer a member")

    def _check_joining(self, quorum: dict[str, Any]) -> None:
        """:meth:`_check`, and the step's joining groups are alive."""
        self._check(quorum)
        self._check_alive(quorum, quorum.get("joining", ()))

    def _link(self, quorum: dict[str, Any], peer: int) -> Any:
        joining = peer in quorum.get("joining", ())
        return self._links.link(
            peer,
            quorum["incarnations"][str(peer)],
            quorum["addresses"][str(peer)][self.rank],
            self.incarnation,
            int(quorum["quorum"]),
            (lambda: self._check_joining(quorum)) if joining else (lambda: self._check(quorum)),
        )

    def _reduce(self, quorum: dict[str, Any]) -> None:
        """Publishes this rank's gradients to the step's other members, and to its joining
        groups (see gradients)."""
        members = [int(g) for g in quorum["members"]]
        links = {g: self._link(quorum, g) for g in members if g != self.group}
        joining: dict[int, Any] = {}
        for g in quorum.get("joining", ()):
            with contextlib.suppress(PeerLost):  # gone: it misses the step, not the members
                joining[int(g)] = self._link(quorum, int(g))
        self._grads.reduce(
            members,
            int(quorum["quorum"]),
            links,
            lambda: self._check(quorum),
            joining,
            lambda: self._check_joining(quorum),
        )

    def _send_state(self, quorum: dict[str, Any]) -> None:
        """This step's state to its recipients, in a thread (see catching_up)."""
        self._transfer.start_sending(
            self.step_count,
            [int(g) for g in quorum["recipients"]],
            {int(g) for g in quorum.get("joining", ())},
            int(quorum["quorum"]),
            lambda g: self._link(quorum, g),
            lambda: self._check_joining(quorum),
        )

    def _receive_state(self, quorum: dict[str, Any]) -> dict[str, Any]:
        donor = self._link(quorum, int(quorum["donor"]))
        return self._transfer.receive(donor, int(quorum["quorum"]), lambda: self._check(quorum))

    def _send_loop(self, quorum: dict[str, Any]) -> None:
        """To each group that joined the last step with this rank's state and is a member
        now: the loop's state after that step (see catching_up)."""
        gave, self._gave = self._gave, {}
        to = [g for g, i in gave.items() if g in quorum["members"] and
              quorum["incarnations"].get(str(g)) == i]  # fmt: skip
        socks = []
        for g in to:
            with contextlib.suppress(PeerLost):  # gone: it loads a whole state later
                socks.append(self._link(quorum, g))
        if socks:
            self._transfer.send_loop(socks, int(quorum["quorum"]), lambda: self._check(quorum))

    def _receive_loop(self, quorum: dict[str, Any]) -> None:
        """The joining group's side of :meth:`_send_loop`, from the donor of the step it joined."""
        assert self._joined_from is not None
        (donor, incarnation), self._joined_from = self._joined_from, None
        if donor not in quorum["members"] or quorum["incarnations"][str(donor)] != incarnation:
            raise PeerLost(f"group {donor}, which gave this group its state, is gone")
        sock = self._link(quorum, donor)
        self._transfer.receive_loop(sock, int(quorum["quorum"]), lambda: self._check(quorum))

    def close(self) -> None:
        """Leaves the membership (at the end of training; also run at exit)."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(PeerLost):
            self._transfer.await_sending()
        # Every rank says so: one that closed its connection unannounced would count as lost.
        with contextlib.suppress(OSError, PeerLost, ValueError):
            self._client.request({"op": "leave", "step": self.step_count})
        self._client.close()
        self._links.close()
        self._grads.close()
