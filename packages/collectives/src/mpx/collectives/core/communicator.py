"""Communicators: a group of ranks, its node structure, and its bookkeeping.

A :class:`Communicator` owns a private duplicate of an MPI communicator, so
mpx's traffic never matches the user's own messages. Beside it, each keeps::

    node comm     ranks sharing memory with this one (MPI_COMM_TYPE_SHARED)
    board         one int64 per node rank in shared memory: the sequence
                  number of the last operation each rank entered. When an
                  operation times out, ranks whose number is behind ours are
                  the ones it waited for, and the error names them.

Creating a communicator, ``split``, ``node`` and ``leaders`` are collective:
every rank of the parent calls them, in the same order.

Each also decides, at creation, how its blocking operations wait
(``yielding``, see :mod:`mpx.collectives.base.handle`): MPI's spinning wait, or,
when this host runs more of the job's ranks than a rank has cores
(``MPX_WAIT=auto``), a polling wait that sleeps and so leaves the cores to
the ranks that compute.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, TypeVar, cast

import numpy as np
from mpi4py import MPI

from mpx.collectives import settings
from mpx.collectives.base import (
    LOCK,
    CommunicatorBroken,
    Handle,
    MismatchError,
    MPXError,
    MPXTypeError,
    MPXValueError,
    Queue,
    Steps,
    as_limit,
    check_timeout,
    drive,
    progress,
)
from mpx.collectives.core.agreement import Agreement
from mpx.collectives.core.call_checks import CallChecks
from mpx.collectives.core.op_specs import OP_SPECS
from mpx.collectives.core.policy import ChoiceCache
from mpx.collectives.core.policy import current as current_policy
from mpx.collectives.node import (
    CallBoard,
    note_host_ranks,
    split_node,
    usable_cores,
    waits_yielding,
)

__all__ = [
    "CommLike",
    "Communicator",
    "as_communicator",
    "usable_cores",
    "waits_yielding",
    "world",
]

T = TypeVar("T")

# Point-to-point matches by source and tag, not by order (op_specs.OP_SPECS).
_UNORDERED = frozenset(name for name, spec in OP_SPECS.items() if not spec.ordered)


class Communicator(Agreement, CallChecks):
    """A group of ranks that run collectives together.

    Attributes:
        mpi: the private MPI communicator.
        rank: this rank's index in the group.
        size: number of ranks.
        timeout: default timeout of every operation (``MPX_TIMEOUT``).
        yielding: blocking operations wait by polling and sleeping, not in
            MPI's spinning wait (decided at creation: :func:`waits_yielding`).
        background_progress: hand unfinished asynchronous operations to the
            progress thread (True by default). A caller that drives its own
            traffic between compute steps (``mpx.pipeline`` polls between
            layers) sets it False: a thread waking every millisecond to poll
            costs a computing core more than it saves there.

    Example::

        comm = world()
        rows = comm.split(color=comm.rank // 2)
        allreduce(torch.ones(4), comm=rows)

    Its agreement across ranks (``agree``, ``agreement``, ``allgather_object``)
    comes from :class:`~mpx.collectives.core.agreement.Agreement`, its ``MPX_CHECK``
    comparisons (``check_signature``, ``check_steps``, ``check_same``,
    ``check_sequence``) from :class:`~mpx.collectives.core.call_checks.CallChecks`.
    """

    def __init__(self, mpi_comm: MPI.Intracomm, timeout: float | None = None) -> None:
        timeout = check_timeout(timeout, "Communicator")
        self.mpi = mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.timeout = settings.TIMEOUT.get() if timeout is None else timeout
        self._node_comm, host_size = split_node(mpi_comm, self.rank)
        # The cores as this module names them: a test makes one rank see one
        # core by replacing communicator.usable_cores.
        self.yielding = waits_yielding(note_host_ranks(host_size), usable_cores())
        self.node_rank: int = self._node_comm.Get_rank()
        self.node_size: int = self._node_comm.Get_size()
        self._node_members = self._node_comm.Get_group().Translate_ranks(
            list(range(self.node_size)), mpi_comm.Get_group()
        )
        self._board_win = MPI.Win.Allocate_shared(
            8 * self.node_size if self.node_rank == 0 else 0, 8, comm=self._node_comm
        )
        buffer, _ = self._board_win.Shared_query(0)
        self._board = np.ndarray((self.node_size,), dtype=np.int64, buffer=cast(Any, buffer))
        self._board[self.node_rank] = 0
        # How many nodes the group spans, and whether every rank follows the
        # same policy (ranks that chose differently would deadlock or mix
        # algorithms): one collective, here, since creation is collective.
        # The devices each rank sees travel too: CUDA IPC (``auto``'s ipc)
        # needs every rank to see its peers' GPUs, which holds when all were
        # started with the same CUDA_VISIBLE_DEVICES on one node.
        visible = settings.cuda_visible_devices()
        mine = (1 if self.node_rank == 0 else 0, current_policy().fingerprint(), visible)
        every = mpi_comm.allgather(mine)
        self.num_nodes: int = sum(leader for leader, _, _ in every)
        self.gpus_shared: bool = self.single_node and len({v for _, _, v in every}) == 1
        differ = [r for r, (_, fp, _) in enumerate(every) if fp != every[0][1]]
        if differ:
            raise MismatchError(
                f"ranks {differ} run a different collectives policy from rank 0 (settings "
                "MPX_AUTO_SMALL_BYTES, MPX_CUDA_AWARE, MPX_COLLECTIVES_IMPL, MPX_CHECK or the "
                "tuned policy file differ); give every rank the same environment and file"
            )
        # Decisions of the policy for this communicator (mpx.collectives.core.policy.choose).
        self.choices = ChoiceCache()
        # Collectives run one at a time, in the same order on every rank (the
        # FIFO queue); their point-to-point traffic (ring) goes on a private
        # duplicate so it never meets the user's send/recv on ``mpi``.
        self._queue = Queue()
        self.collective_mpi = MPI.Intracomm(mpi_comm.Dup())
        self.collective_count = 0
        self._broken: str | None = None
        self._freed = False
        self.background_progress = True
        self._cache: dict[str, Any] = {}
        # MPX_CHECK: where the ranks compare each call (consistency, call_board):
        # the node's shared memory when the group is one node, else MPI.
        self.call_board: CallBoard | None = (
            CallBoard(self._node_comm, list(self._node_members), yielding=self.yielding)
            if self.single_node
            else None
        )
        self.hierarchy: Hierarchy | None = Hierarchy.build(self) if self.num_nodes > 1 else None
        self._node_comm.Barrier()

    # -- construction ---------------------------------------------------------

    @classmethod
    def from_mpi(cls, comm: MPI.Intracomm, timeout: float | None = None) -> Communicator:
        """Wraps (a duplicate of) an mpi4py communicator. Collective.

        Args:
            timeout: default timeout of its operations, seconds > 0 (``math.inf``:
                none); None: ``MPX_TIMEOUT``.
        """
        check_timeout(timeout, "Communicator.from_mpi")  # before the Dup: nothing to free
        if comm == MPI.COMM_NULL:
            raise MPXValueError(
                "from_mpi got MPI.COMM_NULL; only members of a communicator may wrap it"
            )
        return cls(comm.Dup(), timeout)

    def split(self, color: int | None, key: int | None = None) -> Communicator | None:
        """Ranks with the same ``color`` form a new communicator. Collective.

        Args:
            color: group label; None leaves this rank out (it gets None back).
            key: order within the new group; this rank's rank by default.
        """
        self._check_usable("split")
        for name, value in (("color", color), ("key", key)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise MPXTypeError(
                    f"split: {name} must be an int (or None), got {value!r} of type "
                    f"{type(value).__name__}; ranks with equal colors form one group, e.g. "
                    "comm.split(color=comm.rank % 2)"
                )
        if color is not None and color < 0:
            raise MPXValueError(
                f"split: color must be >= 0 or None (None leaves this rank out), got {color}"
            )
        try:
            new = self.mpi.Split(
                MPI.UNDEFINED if color is None else color, self.rank if key is None else key
            )
            if new == MPI.COMM_NULL:
                return None
            try:
                return Communicator(MPI.Intracomm(new), self.timeout)
            except MPI.Exception:
                new.Free()  # its node communicator could not be made: give it back
                raise
        except MPI.Exception as err:
            # MPICH gives a process ~2048 context ids (a split takes several): the usual
            # cause is communicators split off and never freed. Every rank of the split
            # fails alike (the ids are agreed collectively), so every rank raises this.
            if "Too many communicators" not in str(err):
                raise
            raise MPXError(
                "split: MPI has no communicators left in this process (MPICH: about 2048 "
                "context ids, several a communicator); free the ones split off when done: "
                "Communicator.free(), and close() on every mpx network or pipeline that split "
                "its own (LayerParallel, ParallelGRU, TimeStepper, Pipeline)"
            ) from err

    def node(self) -> Communicator:
        """The ranks of this group that share this node's memory. Collective."""
        self._check_usable("node")
        if self.hierarchy is not None:
            return self.hierarchy.node
        if "node" not in self._cache:
            self._cache["node"] = Communicator(self._node_comm.Dup(), self.timeout)
        return self._cache["node"]  # type: ignore[no-any-return]

    def leaders(self) -> Communicator | None:
        """One rank per node (node rank 0); None on the other ranks. Collective."""
        if self.hierarchy is not None:
            return self.hierarchy.leaders
        if "leaders" not in self._cache:
            self._cache["leaders"] = self.split(0 if self.node_rank == 0 else None)
        return self._cache["leaders"]  # type: ignore[no-any-return]

    @property
    def single_node(self) -> bool:
        """True when every rank of the group shares one node."""
        return self.node_size == self.size

    def cached(self, key: str) -> Any:
        """Per-communicator state of an implementation (workspaces, sub-communicators)."""
        return self._cache.get(key)

    def cache(self, key: str, value: T) -> T:
        self._cache[key] = value
        return value

    def free(self) -> None:
        """Releases the MPI resources. Collective.

        Any later use raises :class:`MPXValueError` (the shared memory behind
        the boards is gone: before, a call after ``free`` crashed the process).
        """
        if self._freed:
            return
        self._freed = True
        with LOCK:
            self._queue.abandon(
                CommunicatorBroken(
                    "the communicator was freed (Communicator.free()) before this operation "
                    "finished; its peers may still be waiting in it"
                )
            )
        # The fast path's cached calls name the MPI communicator by its handle,
        # which MPI may give to a new communicator once this one is freed.
        self.choices.reset(current_policy())
        for value in self._cache.values():
            if hasattr(value, "free"):
                value.free()
        self._cache.clear()
        if self.hierarchy is not None:
            self.hierarchy.free()
            self.hierarchy = None
        # A thread may still read the board (a timeout naming who is behind):
        # from now on it reads a private copy, not memory given back to MPI.
        self._board = self._board.copy()
        self._board_win.Free()
        if self.call_board is not None:
            self.call_board.free()
        self.collective_mpi.Free()
        self._node_comm.Free()
        self.mpi.Free()

    def __repr__(self) -> str:
        return f"Communicator(rank={self.rank}, size={self.size}, node_size={self.node_size})"

    # -- running operations ---------------------------------------------------

    def _behind(self) -> list[int]:
        """Ranks on this node that have not entered the current operation."""
        mine = self._board[self.node_rank]
        return [
            int(self._node_members[i])
            for i in range(self.node_size)
            if i != self.node_rank and self._board[i] < mine
        ]

    def _mark_broken(self, op: str) -> None:
        self._broken = op

    def run(
        self, op: str, impl: str, steps: Steps[T], async_op: bool, timeout: float | None
    ) -> T | Handle[T]:
        """Runs an implementation's steps: returns a Handle, or waits for the result."""
        if timeout is not None:
            # Checked here too for the communicator's own collectives (agree,
            # allgather_object ...): before the call counts or starts.
            timeout = check_timeout(timeout, op)
        if self._freed:
            steps.close()
            self._check_usable(op)
        if self._broken is not None:
            steps.close()
            raise CommunicatorBroken(
                f"{op}: an earlier {self._broken} on this communicator timed out, so its "
                "state is unknown; create a new communicator (or restart the job)"
            )
        self._announce()
        limit = as_limit(self.timeout if timeout is None else timeout)
        if not async_op and limit is None:
            with LOCK:
                idle = not self._queue
            if idle:
                # Fast path for blocking calls: nothing queued before us, no
                # deadline, so drive the steps right here -- without the lock,
                # which the progress thread may need meanwhile for another
                # communicator's operation that a peer must finish first.
                return drive(steps, self.yielding)
        handle = Handle(
            op,
            impl,
            steps,
            timeout=limit,
            behind=self._behind,
            on_timeout=lambda: self._mark_broken(op),
            # Point-to-point matches by source and tag: it bypasses the FIFO.
            queue=None if op in _UNORDERED else self._queue,
            yielding=self.yielding,
        )
        if not async_op:
            return handle.wait()
        if self.background_progress and not handle.done():
            progress.watch(self._queue if op not in _UNORDERED else handle)
        return handle

    def _check_usable(self, op: str) -> None:
        if self._freed:
            raise MPXValueError(
                f"{op}: this communicator was freed (Communicator.free()); use another one, "
                "e.g. mpx.collectives.world() or a new comm.split(...) made before the free"
            )

    def _announce(self) -> None:
        """Counts one more operation, on the node's board (timeouts name who is behind).

        This rank's slot of the board is its count (the fast path, which
        counts its calls there too, writes it through a pointer).
        """
        self._board[self.node_rank] += 1


class Hierarchy:
    """The sub-communicators of a group that spans several nodes.

    ::

        2 nodes x 3 ranks        node comms         lanes (same node rank)
        node A: 0 1 2            {0,1,2} {3,4,5}    {0,3} {1,4} {2,5}
        node B: 3 4 5            leaders: {0,3}

    Lanes exist when every node holds the same number of ranks: then node rank
    i reduces chunk i of the node's data across nodes, and every link carries
    a share. Built once, collectively, when the communicator is created (never
    inside an operation, where a collective could interleave with others).

    Example::

        comm = world()
        if comm.hierarchy is not None:
            print(comm.hierarchy.node.size, comm.hierarchy.lanes)
    """

    def __init__(
        self,
        node: Communicator,
        lanes: Communicator | None,
        leaders: Communicator | None,
        node_ranks: Sequence[int],
    ) -> None:
        self.node, self.lanes, self.leaders = node, lanes, leaders
        self.node_ranks = list(node_ranks)  # node rank of every rank of the group

    @classmethod
    def build(cls, comm: Communicator) -> Hierarchy | None:
        layout = comm.mpi.allgather((comm.node_size, comm.node_rank))
        sizes = [size for size, _ in layout]
        if max(sizes) == 1:
            return None  # one rank per node: nothing to compose, the flat ring is it
        node = Communicator(MPI.Intracomm(comm._node_comm.Dup()), comm.timeout)
        equal = min(sizes) == max(sizes)
        lanes = comm.split(comm.node_rank) if equal else None
        leaders = comm.split(0 if comm.node_rank == 0 else None)
        return cls(node, lanes, leaders, [node_rank for _, node_rank in layout])

    def lane_position(self, rank: int) -> tuple[int, int]:
        """``rank``'s node rank, and its rank within its lane (ordered by group rank)."""
        node_rank = self.node_ranks[rank]
        return node_rank, sum(1 for q in range(rank) if self.node_ranks[q] == node_rank)

    def free(self) -> None:
        for sub in (self.node, self.lanes, self.leaders):
            if sub is not None:
                sub.free()


@functools.cache
def world() -> Communicator:
    """The communicator over all ranks of the job (a duplicate of COMM_WORLD).

    Collective on first call; later calls return the same object.
    """
    return Communicator(MPI.COMM_WORLD.Dup())


CommLike = Communicator | MPI.Intracomm
"""What every ``comm=`` of mpx takes: a :class:`Communicator` or an mpi4py intracommunicator."""

# mpi4py communicators already wrapped: MPI handle -> (the mpi4py object, its Communicator).
_wrapped: dict[int, tuple[MPI.Intracomm, Communicator]] = {}


def as_communicator(comm: CommLike | None) -> Communicator:
    """The :class:`Communicator` for ``comm=``: itself, the world for None, or a wrapper.

    torchbraid and plain mpi4py code pass ``comm=MPI.COMM_WORLD``; every ``comm=``
    of mpx accepts that. An mpi4py communicator is wrapped once (collective:
    every rank of it must pass it the first time, as they do when they call
    the same collective) and the wrapper is reused while that communicator lives.

    Raises:
        MPXTypeError: for anything else, naming its type.
    """
    if comm is None:
        return world()
    if isinstance(comm, Communicator):
        return comm
    if isinstance(comm, MPI.Intracomm):
        if comm == MPI.COMM_NULL:
            raise MPXValueError(
                "comm is MPI.COMM_NULL: only members of a communicator may use it; pass "
                "comm= only on the ranks the communicator contains"
            )
        key = int(comm.handle)
        found = _wrapped.get(key)
        if found is not None:
            original, wrapper = found
            if original != MPI.COMM_NULL and MPI.Comm.Compare(original, comm) == MPI.IDENT:
                return wrapper
        # COMM_WORLD's group is the world's: share its state (and its call board).
        wrapper = world() if comm == MPI.COMM_WORLD else Communicator.from_mpi(comm)
        _wrapped[key] = (comm, wrapper)
        return wrapper
    raise MPXTypeError(
        f"comm must be an mpx.collectives.Communicator, an mpi4py intracommunicator "
        f"(e.g. MPI.COMM_WORLD) or None, got {type(comm).__name__}"
    )
