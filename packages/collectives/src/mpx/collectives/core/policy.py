"""Which implementation runs a call: per op an ordered list, and one policy.

Every caller that must pick an implementation -- the operations, the
small-call fast path, ``staged`` choosing its host algorithm, ``hier``
choosing its cross-node step, point-to-point -- asks :func:`choose`. It walks
the op's list below (as Horovod walks its per-op lists); the first entry
enabled for the call under the current :class:`Policy`, whose implementation
provides the op and accepts the call -- its dtype, reduce op and size, as the
implementation declares them (:class:`mpx.collectives.core.registry.Implementation`)
-- wins::

    op                 ordered implementations (first enabled wins; :func:`order_table`)
    -----------------  -------------------------------------------------------
    allreduce          shm<small  mpi<small  shm  hier  ring  ring(tuned)  ipc>=large
                         mpi(cuda-aware)  staged  mpi
    broadcast          mpi<small  shm  hier  ring  ring(tuned)  ipc>=large
                         mpi(cuda-aware)  staged  mpi
    allgather          mpi<small  shm  ring  ring(tuned)  mpi(cuda-aware)  staged  mpi
    reduce_scatter     mpi<small  ring  ring(tuned)  mpi(cuda-aware)  staged  mpi
    reduce, alltoall,  mpi(cuda-aware)  staged  mpi
    send, recv
    barrier            mpi

    shm<small        CPU, every rank (several) on one node, a sum or avg of a
                     dtype shm's flag kernel sums, at most the policy's
                     flag_bytes (MPX_SHM_FLAG_BYTES; mpx.collectives.node.shm_flags)
    mpi<small        CPU, and a single rank or fewer bytes than the policy's
                     small-message threshold (MPI's latency is unbeatable there)
    shm              CPU, every rank on one node
    hier             CPU, several nodes, more than one rank on some node
    ring             CPU, several nodes
    ring(tuned)      CPU, where a tuned policy measured ring fastest (on one node too)
    ipc>=large       CUDA tensor of at least the policy's ipc threshold
                     (MPX_AUTO_IPC_BYTES), every rank on one node seeing the
                     same GPUs (the same CUDA_VISIBLE_DEVICES)
    mpi(cuda-aware)  CUDA tensor and MPX_CUDA_AWARE=1
    staged           CUDA tensor
    mpi              the fallback for CPU tensors

An entry is taken only where its implementation says ``auto`` may take the
call (:meth:`mpx.collectives.core.registry.Implementation.auto_takes`: it is
``automatic``, provides the op and accepts the device, layout, dtype, reduce
op and size): the registry is the one authority on what an implementation
takes, the lists on the order. The collectives README shows the lists as
:func:`order_table` prints them (a test compares the two).

``ipc`` (CUDA IPC within a node) needs every rank to see its peers' GPUs:
``auto`` takes it only where the ranks were started with the same visible
devices (one GPU shared, or all visible), which communicator creation checks
(``Communicator.gpus_shared``); with one GPU bound to each rank, name it with
``impl="ipc"`` after making them visible. Not chosen by ``auto`` are ``gloo``
(CPU) and ``nccl`` (CUDA), torch's own process groups over the same ranks
(:mod:`mpx.collectives.impl.c10d`), there to compare with, as TorchMPI offered.

The policy holds the threshold, CUDA-awareness and, when ``mpxrun --tune``
has measured this machine and rank layout, the measured winner of each size
band (then an entry is enabled only where it won). Every rank reaches the
same decision: shapes and dtypes agree across ranks, and communicators check
at creation that their ranks run the same policy.

Decisions are cached per communicator and size; the first of each (op,
device, size class) is logged on the ``mpx.collectives`` logger at DEBUG.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mpx.collectives import settings
from mpx.collectives.base import MPXError
from mpx.collectives.core.op_specs import OP_SPECS, OPS
from mpx.collectives.core.registry import BUILT_IN, RegistryError
from mpx.collectives.core.registry import get as implementation
from mpx.collectives.node import FLAG_BYTES, flags_take
from mpx.launch.settings import on_reload

__all__ = [
    "COMPARE_ONLY",
    "IMPLEMENTATIONS",
    "OPS",
    "ORDER",
    "Entry",
    "Layout",
    "Policy",
    "PolicyError",
    "builtin_choice",
    "choose",
    "current",
    "default_policy_file",
    "layout_key",
    "order_table",
    "small_bytes",
]

LOG = logging.getLogger("mpx.collectives")

# The implementations by name (mpx.collectives.core.registry holds each one's
# declaration: the ops it provides, the devices and layouts it accepts).
IMPLEMENTATIONS = tuple(impl.name for impl in BUILT_IN)
"""The built-in implementations that ``impl=`` names (besides ``"auto"``, the policy's
choice); other packages add theirs through ``mpx.collectives.core.registry``."""
# Operations whose CPU algorithms the tuner times and the policy can band.
TUNABLE = ("allreduce", "broadcast", "allgather", "reduce_scatter")


class Layout(Protocol):
    """What the policy needs of a communicator: its rank layout and its decisions.

    (:class:`mpx.collectives.Communicator` is one; the policy needs no more of
    it, so it sits below the communicator and the implementations.)
    """

    @property
    def size(self) -> int: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def node_size(self) -> int: ...
    @property
    def single_node(self) -> bool: ...
    @property
    def gpus_shared(self) -> bool: ...
    @property
    def hierarchy(self) -> object | None: ...
    @property
    def choices(self) -> ChoiceCache: ...


class PolicyError(MPXError, ValueError):
    """A policy file cannot be read, or an implementation cannot take this call."""


@dataclass(frozen=True)
class Call:
    """What the decision depends on: the op, the device, the bytes, the communicator,
    and what an implementation may decline (dtype, reduce op: ``registry.Implementation``)."""

    op: str
    cuda: bool
    nbytes: int
    comm: Layout
    dtype: Any = None
    reduce_op: str = ""

    def declined_by(self, name: str) -> str | None:
        """Why implementation ``name`` does not accept this call (its declarations), or None."""
        return implementation(name).declines(self.dtype, self.reduce_op, self.nbytes)


@dataclass(frozen=True)
class Entry:
    """One line of an op's ordered list: an implementation and when it is enabled."""

    impl: str
    enabled: Callable[[Call, Policy], bool]
    label: str = ""

    def __repr__(self) -> str:
        return f"Entry({self.label or self.impl})"


def _cpu(call: Call) -> bool:
    return not call.cuda


def _mpi_small(call: Call, policy: Policy) -> bool:
    if call.cuda:
        return False
    if call.comm.size == 1:
        return True  # nothing to communicate: no algorithm beats MPI's copy
    won = policy.tuned_winner(call)
    if won is not None:
        return won == "mpi"
    return call.comm.size == 1 or call.nbytes < policy.small_bytes


def _banded(impl: str, fits: Callable[[Call], bool]) -> Callable[[Call, Policy], bool]:
    """Enabled where the layout fits and, if tuned, where ``impl`` won this size."""

    def enabled(call: Call, policy: Policy) -> bool:
        if call.cuda or not fits(call):
            return False
        won = policy.tuned_winner(call)
        return won is None or won == impl

    return enabled


def _shm_small(call: Call, policy: Policy) -> bool:
    """shm's flag-based allreduce (``mpx.collectives.node.shm_flags``): the call it takes."""
    if call.cuda or call.op != "allreduce":
        return False
    comm = call.comm
    if not flags_take(
        comm.size, comm.single_node, call.dtype, call.reduce_op, call.nbytes, policy.flag_bytes
    ):
        return False
    won = policy.tuned_winner(call)
    return won is None or won == "shm"


# 2 ranks of one node, 64 KiB, one job: 0.30 ms a call through MPICH's allreduce,
# 0.09 ms through the flags (a loaded host, load ~20; issue 46). It needs the
# dtype and op, so a call without them (choose's defaults) goes on to mpi<small.
_SHM_SMALL = Entry("shm", _shm_small, "shm<small")
_MPI_SMALL = Entry("mpi", _mpi_small, "mpi<small")
_SHM = Entry("shm", _banded("shm", lambda c: c.comm.size > 1 and c.comm.single_node))
_HIER = Entry("hier", _banded("hier", lambda c: c.comm.hierarchy is not None))
_RING = Entry("ring", _banded("ring", lambda c: c.comm.size > 1 and not c.comm.single_node))
# On one node ring is never the default (shm wins there), but a tuned policy
# may find it faster for some sizes: it is enabled only where it won.
_RING_TUNED = Entry(
    "ring",
    lambda call, policy: not call.cuda and policy.tuned_winner(call) == "ring",
    "ring(tuned)",
)
# On an H200 with two ranks, ipc was 3.4-4.6x staged from 16 MiB but cost
# ~0.9 ms a call, where staged took 0.2-0.5 ms up to 1 MiB (BENCHMARKS.md).
_IPC = Entry(
    "ipc",
    lambda call, policy: (
        call.cuda
        and call.comm.size > 1
        and call.comm.gpus_shared
        and 0 < policy.ipc_bytes <= call.nbytes
    ),
    "ipc>=large",
)
_MPI_CUDA = Entry("mpi", lambda call, policy: call.cuda and policy.cuda_aware, "mpi(cuda-aware)")
_STAGED = Entry("staged", lambda call, policy: call.cuda)
_MPI = Entry("mpi", lambda call, policy: not call.cuda, "mpi")

_P2P = (_MPI_CUDA, _STAGED, _MPI)
ORDER: dict[str, tuple[Entry, ...]] = {
    "allreduce": (
        _SHM_SMALL,
        _MPI_SMALL,
        _SHM,
        _HIER,
        _RING,
        _RING_TUNED,
        _IPC,
        _MPI_CUDA,
        _STAGED,
        _MPI,
    ),
    "broadcast": (_MPI_SMALL, _SHM, _HIER, _RING, _RING_TUNED, _IPC, _MPI_CUDA, _STAGED, _MPI),
    "allgather": (_MPI_SMALL, _SHM, _RING, _RING_TUNED, _MPI_CUDA, _STAGED, _MPI),
    "reduce_scatter": (_MPI_SMALL, _RING, _RING_TUNED, _MPI_CUDA, _STAGED, _MPI),
    "reduce": _P2P,
    "alltoall": _P2P,
    "send": _P2P,
    "recv": _P2P,
    "barrier": (_MPI,),
}


def order_table() -> str:
    """The ordered lists as text: one line per group of ops with the same list.

    The collectives README shows this (``tests/test_policy.py`` checks it)::

        allreduce, broadcast          mpi<small  shm  hier  ring  ...  staged  mpi
        ...
        barrier                       mpi
    """
    groups: dict[tuple[Entry, ...], list[str]] = {}
    for op, entries in ORDER.items():
        groups.setdefault(entries, []).append(op)
    rows = [
        (", ".join(ops), "  ".join(entry.label or entry.impl for entry in entries))
        for entries, ops in groups.items()
    ]
    width = max(len(ops) for ops, _ in rows)
    return "\n".join(f"{ops:<{width}}  {entries}" for ops, entries in rows)


def layout_key(comm: Layout) -> str:
    """The rank layout a tuned policy was measured for: ranks, nodes, ranks per node."""
    return f"ranks={comm.size},nodes={comm.num_nodes},node_size={comm.node_size}"


# MPX_POLICY_FILE=none: the built-in rules, whatever tuning files exist.
_NO_FILE = frozenset({"none", "builtin", "built-in"})


def default_policy_file() -> Path:
    """Where ``mpxrun --tune`` writes and ``auto`` reads: ``MPX_POLICY_FILE``, else
    ``$XDG_CACHE_HOME/mpx/policy-<host>.json`` (``~/.cache`` without XDG_CACHE_HOME)."""
    chosen = settings.POLICY_FILE.get()
    if chosen and chosen.lower() not in _NO_FILE:
        return Path(chosen)
    cache = settings.XDG_CACHE_HOME.get() or str(Path.home() / ".cache")
    return Path(cache) / "mpx" / f"policy-{socket.gethostname()}.json"


@dataclass
class Policy:
    """The rules ``auto`` follows: thresholds, CUDA-awareness, measured bands.

    Attributes:
        small_bytes: below this, MPI's own collectives (``MPX_AUTO_SMALL_BYTES``).
        flag_bytes: up to this, shm's flag-based small allreduce
            (``MPX_SHM_FLAG_BYTES``; 0: off).
        ipc_bytes: from this, CUDA IPC for CUDA tensors where every rank sees
            the same GPUs (``MPX_AUTO_IPC_BYTES``; 0: never).
        cuda_aware: MPI takes CUDA buffers (``MPX_CUDA_AWARE``).
        impl: the implementation every call without ``impl=`` uses
            (``MPX_COLLECTIVES_IMPL``; ``"auto"`` lets the lists decide).
        check: the cross-rank check of calls, ``"auto"``, ``"1"`` or ``"0"`` (``MPX_CHECK``).
        tuned: layout key -> op -> list of ``[up_to_bytes, impl]`` bands
            (exclusive upper bounds, ascending), from a tuning file.
        source: where the bands came from (a path), or ``"built-in"``.

    Example::

        from mpx.collectives.core import policy
        p = policy.current()
        print(p.small_bytes, p.source, p.describe(world()))
    """

    small_bytes: int
    cuda_aware: bool
    impl: str
    check: str
    tuned: dict[str, dict[str, list[tuple[int, str]]]] = field(default_factory=dict)
    source: str = "built-in"
    ipc_bytes: int = settings.IPC_BYTES.default  # one default: the setting's
    flag_bytes: int = FLAG_BYTES.default
    _log_seen: set[tuple[str, bool, int]] = field(default_factory=set, repr=False)

    @classmethod
    def from_settings(cls) -> Policy:
        """The policy of the environment's settings and the tuning file, if there is one."""
        path = default_policy_file()
        tuned: dict[str, dict[str, list[tuple[int, str]]]] = {}
        source = "built-in"
        if settings.POLICY_FILE.get().lower() in _NO_FILE:
            pass
        elif path.is_file():
            tuned = load_bands(path)
            source = str(path)
        elif settings.POLICY_FILE.get():
            raise PolicyError(
                f"MPX_POLICY_FILE={str(path)!r} does not exist; write it with "
                "`mpxrun -n N --tune` (or unset MPX_POLICY_FILE for the built-in policy)"
            )
        return cls(
            small_bytes=settings.SMALL_BYTES.get(),
            cuda_aware=settings.CUDA_AWARE.get(),
            impl=settings.IMPL.get(),
            check=settings.CHECK.get(),
            tuned=tuned,
            source=source,
            ipc_bytes=settings.IPC_BYTES.get(),
            flag_bytes=FLAG_BYTES.get(),
        )

    def bands(self, comm: Layout) -> dict[str, list[tuple[int, str]]] | None:
        """The tuned bands for this communicator's layout, or None (built-in rules)."""
        if not self.tuned:
            return None
        return self.tuned.get(layout_key(comm))

    def tuned_winner(self, call: Call) -> str | None:
        """The implementation measured fastest for this call's op and size, if tuned."""
        layout = self.bands(call.comm)
        if layout is None:
            return None
        bands = layout.get(call.op)
        if not bands:
            return None
        for up_to, impl in bands:
            if call.nbytes < up_to:
                return impl
        return bands[-1][1]

    def fingerprint(self) -> int:
        """A 63-bit digest of everything a decision depends on (ranks must agree on it)."""
        text = json.dumps(
            [
                self.small_bytes,
                self.ipc_bytes,
                self.flag_bytes,
                self.cuda_aware,
                self.impl,
                self.check,
                sorted(self.tuned.items()),
            ],
            sort_keys=True,
        )
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    def describe(self, comm: Layout) -> str:
        """One line: the policy's source and the rules for this communicator."""
        bands = self.bands(comm)
        if bands is None:
            rule = f"built-in: mpi below {self.small_bytes} bytes"
        else:
            rule = "tuned " + "; ".join(
                f"{op}: " + ", ".join(f"<{up}:{impl}" for up, impl in b) for op, b in bands.items()
            )
        return f"policy {self.source} ({layout_key(comm)}): {rule}"


def load_bands(path: Path) -> dict[str, dict[str, list[tuple[int, str]]]]:
    """The bands of a tuning file (``mpx.collectives.tune`` writes it)."""
    try:
        data = json.loads(path.read_text())
        layouts = data["layouts"]
        return {
            key: {
                op: [(int(up), str(impl)) for up, impl in entry["bands"][op]]
                for op in entry["bands"]
                if op in TUNABLE
            }
            for key, entry in layouts.items()
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise PolicyError(
            f"cannot read the tuned policy {str(path)!r} ({exc}); run `mpxrun -n N --tune` "
            "again, or delete the file for the built-in policy"
        ) from None


_current: list[Policy] = []


def current() -> Policy:
    """The policy in force (built from the settings at first use; see ``reload``)."""
    if not _current:
        _current.append(Policy.from_settings())
    return _current[0]


def _forget() -> None:
    _current.clear()


on_reload(_forget)


def small_bytes() -> int:
    """Below this many bytes MPI's own collectives win (the policy's threshold)."""
    return current().small_bytes


# -- choosing -----------------------------------------------------------------

COMPARE_ONLY = frozenset(i.name for i in BUILT_IN if not i.automatic and "cpu" in i.devices)
"""CPU implementations ``auto`` never picks (nor tuning): torch's groups, to compare with."""


def _walk(call: Call, policy: Policy) -> str:
    """The first entry of the op's list that is enabled and whose implementation ``auto``
    may give the call, as the registry declares it (``Implementation.auto_takes``)."""
    for entry in ORDER[call.op]:
        if entry.enabled(call, policy) and implementation(entry.impl).auto_takes(
            call.op,
            call.cuda,
            call.comm,
            policy.cuda_aware,
            call.dtype,
            call.reduce_op,
            call.nbytes,
        ):
            return entry.impl
    raise PolicyError(  # unreachable with the built-in lists: each ends in mpi, which takes all
        f"{call.op}: no implementation accepts a {'CUDA' if call.cuda else 'CPU'} "
        f"tensor of {call.nbytes} bytes ({call.dtype}, op {call.reduce_op or '-'})"
    )


def builtin_choice(op: str, nbytes: int, comm: Layout) -> str:
    """What the built-in rules (no tuned bands) run for a CPU tensor of ``nbytes``."""
    untuned = dataclasses.replace(current(), tuned={}, source="built-in", _log_seen=set())
    return _walk(Call(op, False, nbytes, comm), untuned)


def _named(call: Call, name: str, policy: Policy, explicit: bool) -> str:
    """Checks a named implementation; falls back for ops it does not have.

    A call it declines (dtype, reduce op, size: its declarations) raises where
    ``impl=`` named it (``explicit``), and goes the way ``auto`` would where
    only ``MPX_COLLECTIVES_IMPL`` did: that setting is every call's default,
    and one op it cannot run (a ``max`` of a metric under ``cgx``) must not
    stop the job.
    """
    comm, op = call.comm, call.op
    try:
        named = implementation(name)
    except RegistryError as error:
        raise PolicyError(f"{op}: {error}") from None
    refusal = named.refusal(op, call.cuda, comm, policy.cuda_aware)
    if refusal is not None:
        raise PolicyError(f"{op}: {refusal}")
    if op not in named.provides:
        return "staged" if call.cuda and not policy.cuda_aware else "mpi"
    declined = call.declined_by(name)
    if declined is not None:
        if explicit:
            raise PolicyError(f"{op}: {declined}")
        return _walk(call, policy)
    return name


def choose(
    op: str,
    cuda: bool,
    nbytes: int,
    comm: Layout,
    impl: str | None = None,
    dtype: Any = None,
    reduce_op: str = "",
) -> str:
    """The name of the implementation that runs this call (``impl=None``: ``MPX_COLLECTIVES_IMPL``).

    ``dtype`` (a ``torch.dtype``; None: any) and ``reduce_op`` (``""``: the
    op reduces nothing) are what implementations may decline: ``auto``
    passes one that declines by, ``impl=`` naming one raises. Point-to-point
    and barrier always run on MPI (through pinned memory for CUDA tensors
    unless MPI is CUDA-aware), whatever ``impl`` says.

    Raises:
        PolicyError: an unknown name, ``shm``/``ipc`` across nodes, ``hier``
            on one node, a device the implementation cannot take, or a dtype,
            reduce op or size it declines (the message names the value and
            what to use instead).
    """
    policy = current()
    key = (op, cuda, nbytes, impl, dtype, reduce_op)
    cache = comm.choices
    if cache.policy is policy:
        hit = cache.get(key)
        if hit is not None:
            return hit
    else:
        cache.reset(policy)
    call = Call(op, cuda, nbytes, comm, dtype, reduce_op)
    name = impl or policy.impl
    if not OP_SPECS[op].policy:
        name = "auto"  # point to point and barrier: MPI runs them, whatever impl says
    chosen = _walk(call, policy) if name == "auto" else _named(call, name, policy, impl is not None)
    cache[key] = chosen
    size_class = max(nbytes, 1).bit_length()
    if LOG.isEnabledFor(logging.DEBUG) and (op, cuda, size_class) not in policy._log_seen:
        policy._log_seen.add((op, cuda, size_class))
        LOG.debug(
            "%s of a %s tensor of %d bytes (class 2^%d) on %s: %s (asked %s; %s)",
            op,
            "CUDA" if cuda else "CPU",
            nbytes,
            size_class - 1,
            layout_key(comm),
            chosen,
            name,
            policy.source,
        )
    return chosen


class ChoiceCache(dict[tuple[str, bool, int, str | None, Any, str], str]):
    """A communicator's decisions under one policy (dropped when the policy changes)."""

    # Bounded: a program calling with ever new sizes must not grow it forever.
    LIMIT = 4096

    def __init__(self) -> None:
        super().__init__()
        self.policy: Policy | None = None
        # The small-call fast path's calls and plans (mpx.collectives.core.fast_path),
        # which follow from the decisions here and go with them.
        self.fast: dict[Any, Any] = {}

    def reset(self, policy: Policy) -> None:
        self.clear()
        self.fast.clear()
        self.policy = policy

    def __setitem__(self, key: Any, value: str) -> None:
        if len(self) >= self.LIMIT:
            self.clear()
            self.fast.clear()
        super().__setitem__(key, value)
