"""The registry of implementations: one object per implementation, in one place.

Each implementation is an :class:`Implementation`: its name, the ops it
provides, what it accepts -- devices, rank layouts, dtypes, reduce ops, sizes,
tensors that require grad -- whether ``auto`` may pick it, and the module
whose op functions run its calls. The policy (:mod:`mpx.collectives.core.policy`)
decides among the implementations that accept a call; the operations
(:mod:`mpx.collectives.core.ops`) run the one it chose::

    ops.allreduce(t)                  validation, autograd, the check: once
      policy.choose(op, cuda, bytes,  the op's ordered list; each entry names an
        dtype, reduce_op)             implementation: is the entry enabled, and
        registry.get(name)            may auto give it the call (.auto_takes:
          .auto_takes(...)            automatic, provides the op, accepts the
                                      device and layout (.refusal) and the
                                      dtype, reduce op and size (.declines))?
      dispatch: t.data, or t itself   as its requires_grad says (.takes_autograd)
      registry.get(chosen)
        .function("allreduce")        the module's op function: a generator of steps

An implementation that declines a call is skipped by ``auto``'s walk; one named
with ``impl=`` raises ``mpx.collectives.core.policy.PolicyError`` naming the value it
declines and what to use instead.

Other packages add implementations through the entry-point group
``mpx.collectives.implementations`` (the entry point names an
:class:`Implementation` object), as mpx-quantize adds ``cgx``, its quantized
allreduce. Those are found on the first lookup of a name that is not built in,
so importing mpx.collectives imports no other package (they import it).

Every op function takes the communicator, the tensor and the op's own
arguments -- ``allreduce(comm, t, op)``, ``broadcast(comm, t, root)``,
``reduce(comm, t, root, op)``, ``allgather(comm, t)``, ``reduce_scatter(comm,
t, op)``, ``alltoall(comm, t)``, ``send(comm, t, dest, tag)``, ``recv(comm, t,
source, tag)``, ``barrier(comm)`` -- and returns the steps
(:class:`mpx.collectives.base.handle.Steps`) the communicator drives. It gets a
tensor already validated (dtype, device, contiguity) and without autograd.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from typing import Any, ParamSpec, Protocol, TypeVar

import torch

from mpx.collectives.base import REDUCE_OPS, Done, MPXError, Pending
from mpx.collectives.core.op_specs import OPS

__all__ = [
    "BUILT_IN",
    "ENTRY_POINT_GROUP",
    "GRAD_HANDLING",
    "Implementation",
    "Placement",
    "RegistryError",
    "all_implementations",
    "blocking",
    "get",
]

P = ParamSpec("P")
T = TypeVar("T")

ENTRY_POINT_GROUP = "mpx.collectives.implementations"

GRAD_HANDLING = ("detached", "as is")
"""What an implementation may do with a tensor that requires grad (its ``requires_grad``)."""


class RegistryError(MPXError, ValueError):
    """An implementation's name is unknown, registered twice, or cannot take a call."""


class Placement(Protocol):
    """What an implementation's layout rule needs of a communicator."""

    @property
    def single_node(self) -> bool: ...
    @property
    def num_nodes(self) -> int: ...
    @property
    def node_size(self) -> int: ...
    @property
    def hierarchy(self) -> object | None: ...


@dataclass(frozen=True)
class Implementation:
    """One implementation of collectives, as the registry knows it.

    Attributes:
        name: what ``impl=`` and ``MPX_COLLECTIVES_IMPL`` call it.
        module: the module holding its op functions (imported on first use).
        provides: the ops it runs itself; a call that names it for another op
            falls back to ``mpi`` (CPU tensors) or ``staged`` (CUDA ones).
        devices: ``"cpu"``, ``"cuda"``, and ``"cuda-aware"`` for CUDA tensors
            only when the MPI is CUDA-aware (``MPX_CUDA_AWARE=1``).
        layout: ``"any"``, ``"one node"`` (every rank shares memory) or
            ``"several nodes"`` (more than one rank on some node).
        automatic: ``auto`` may pick it (and the tuner time it), for the calls
            the rest of its declarations accept (:meth:`auto_takes`: what
            :func:`mpx.collectives.core.policy.choose` asks of every entry of an
            op's list); False for the ones to compare with (torch's gloo and
            nccl) and the lossy ones (cgx), which run only where named.
        attribute: the object of ``module`` whose methods are the op functions
            (``""``: the module's own functions).
        summary: one line for docs and ``--check``.
        dtypes: the dtypes it takes (None: every dtype mpx supports).
        reduce_ops: the reduce ops it runs (None: every one, ``sum`` ``avg``
            ``max`` ``min`` ``prod``); a call without one (broadcast) is not
            affected.
        max_bytes: the largest tensor it takes, in bytes (None: no limit).
        requires_grad: what its op functions get for a tensor that requires
            grad: ``"detached"`` (the default, every built-in one) -- the
            tensor's memory without autograd (``t.data``), handed over by the
            operations, which gives gloo's semantics on every implementation;
            ``"as is"`` -- the caller's tensor itself, for an implementation
            that records autograd itself.

    A call the implementation does not accept (:meth:`refusal`,
    :meth:`declines`) is never given to it: ``auto`` passes it by, and
    ``impl=`` naming it raises before anything moves.

    Example::

        Implementation(
            "mine", "my_package.collectives", frozenset({"allreduce"}),
            frozenset({"cpu"}), automatic=False,
            dtypes=frozenset({torch.float32}), reduce_ops=frozenset({"sum", "avg"}),
        )
    """

    name: str
    module: str
    provides: frozenset[str]
    devices: frozenset[str]
    layout: str = "any"
    automatic: bool = True
    attribute: str = ""
    summary: str = ""
    dtypes: frozenset[torch.dtype] | None = None
    reduce_ops: frozenset[str] | None = None
    max_bytes: int | None = None
    requires_grad: str = "detached"

    def __post_init__(self) -> None:
        unknown = set(self.provides) - set(OPS)
        if unknown:
            raise RegistryError(
                f"implementation {self.name!r} declares unknown ops {sorted(unknown)}; "
                f"the ops are {', '.join(OPS)}"
            )
        if self.layout not in ("any", "one node", "several nodes"):
            raise RegistryError(
                f"implementation {self.name!r}: layout must be 'any', 'one node' or "
                f"'several nodes', got {self.layout!r}"
            )
        if self.requires_grad not in GRAD_HANDLING:
            raise RegistryError(
                f"implementation {self.name!r}: requires_grad must be one of "
                f"{', '.join(map(repr, GRAD_HANDLING))}, got {self.requires_grad!r}"
            )
        if self.dtypes is not None and not all(isinstance(d, torch.dtype) for d in self.dtypes):
            raise RegistryError(
                f"implementation {self.name!r}: dtypes must be torch dtypes (e.g. "
                f"torch.float32), got {', '.join(sorted(map(repr, self.dtypes)))}"
            )
        if self.reduce_ops is not None and not set(self.reduce_ops) <= set(REDUCE_OPS):
            raise RegistryError(
                f"implementation {self.name!r}: reduce_ops must be among "
                f"{', '.join(REDUCE_OPS)}, got {sorted(self.reduce_ops)}"
            )
        if self.max_bytes is not None and (
            isinstance(self.max_bytes, bool) or not isinstance(self.max_bytes, int)
        ):
            raise RegistryError(
                f"implementation {self.name!r}: max_bytes must be an int or None, "
                f"got {self.max_bytes!r}"
            )

    def takes_cuda(self, cuda_aware: bool) -> bool:
        return "cuda" in self.devices or ("cuda-aware" in self.devices and cuda_aware)

    def refusal(self, op: str, cuda: bool, comm: Placement, cuda_aware: bool) -> str | None:
        """Why this implementation cannot take the call, as the end of an error; or None."""
        if self.layout == "one node" and not comm.single_node:
            return (
                f"impl={self.name!r} needs every rank on one node, but this communicator spans "
                f"{comm.num_nodes} nodes; use impl='hier', 'ring' or 'auto'"
            )
        if self.layout == "several nodes" and comm.hierarchy is None:
            return (
                f"impl={self.name!r} needs ranks on several nodes with more than one rank on "
                f"some node; this communicator has {comm.num_nodes} node(s) of "
                f"{comm.node_size} rank(s) here; use impl='shm', 'ring' or 'auto'"
            )
        if cuda and not self.takes_cuda(cuda_aware):
            return (
                f"impl={self.name!r} takes CPU tensors; for a CUDA tensor use impl='staged' "
                "(or 'auto'), 'ipc' within a node, 'nccl', or 'mpi' with a CUDA-aware MPI "
                "(MPX_CUDA_AWARE=1); or move it with t.cpu()"
            )
        if not cuda and "cpu" not in self.devices:
            return f"impl={self.name!r} takes CUDA tensors, got a CPU one; use impl='auto'"
        return None

    def declines(self, dtype: torch.dtype | None, reduce_op: str, nbytes: int) -> str | None:
        """Why this implementation does not take a tensor of ``dtype`` and ``nbytes`` reduced
        with ``reduce_op`` (``""``: the op reduces nothing), as the end of an error; or None.

        What the declarations ``dtypes``, ``reduce_ops`` and ``max_bytes`` say
        (a tensor that requires grad is taken by every one: ``requires_grad``
        only decides what the op function gets, :attr:`takes_autograd`).
        """
        if self.dtypes is not None and dtype is not None and dtype not in self.dtypes:
            takes = sorted(str(d).replace("torch.", "") for d in self.dtypes)
            return (
                f"impl={self.name!r} takes dtypes {', '.join(takes)}, got "
                f"{str(dtype).replace('torch.', '')}; convert the tensor (e.g. "
                f"t.to(torch.{takes[0]})) or use impl='auto'"
            )
        if self.reduce_ops is not None and reduce_op and reduce_op not in self.reduce_ops:
            return (
                f"impl={self.name!r} reduces with {', '.join(sorted(self.reduce_ops))}, got "
                f"op={reduce_op!r}; use impl='auto' (or another implementation) for it"
            )
        if self.max_bytes is not None and nbytes > self.max_bytes:
            return (
                f"impl={self.name!r} takes tensors of at most {self.max_bytes} bytes, got "
                f"{nbytes}; split the tensor, or use impl='auto'"
            )
        return None

    def auto_takes(
        self,
        op: str,
        cuda: bool,
        comm: Placement,
        cuda_aware: bool,
        dtype: torch.dtype | None,
        reduce_op: str,
        nbytes: int,
    ) -> bool:
        """Whether ``auto`` may give it this call: ``automatic``, provides ``op``, takes
        the device and layout (:meth:`refusal`) and the dtype, reduce op and size
        (:meth:`declines`). The policy orders the asking (:mod:`mpx.collectives.core.policy`)."""
        return (
            self.automatic
            and op in self.provides
            and self.refusal(op, cuda, comm, cuda_aware) is None
            and self.declines(dtype, reduce_op, nbytes) is None
        )

    @property
    def takes_autograd(self) -> bool:
        """Whether its op functions get a tensor that requires grad as is (not ``t.data``)."""
        return self.requires_grad == "as is"

    def function(self, op: str) -> Callable[..., Any]:
        """The op function that runs ``op`` (the module is imported on first use)."""
        found = _functions.get((self.name, op))
        if found is None:
            owner: Any = importlib.import_module(self.module)
            if self.attribute:
                owner = getattr(owner, self.attribute)
            found = getattr(owner, op, None)
            if found is None:
                raise RegistryError(
                    f"implementation {self.name!r} declares {op} but {self.module}"
                    f"{'.' + self.attribute if self.attribute else ''} has no {op}()"
                )
            _functions[(self.name, op)] = found
        return found


_functions: dict[tuple[str, str], Callable[..., Any]] = {}


def blocking(function: Callable[P, T]) -> Callable[P, Generator[Pending, None, T]]:
    """An op function made of a blocking one: it runs whole when its operation's turn comes.

    For implementations built from other collectives (a quantized allreduce
    is an alltoall and an allgather): the call still takes its turn in the
    communicator's order, and ``async_op=True`` returns at once, but the
    work runs in one piece when the handle (or the progress thread) reaches
    it. Run the inner collectives on a communicator of their own: the outer
    one is busy with this very operation.

    Example::

        @blocking
        def allreduce(comm, t, op):
            my_quantized_allreduce(t, private_communicator(comm), op)
            return t
    """

    def steps(*args: P.args, **kwargs: P.kwargs) -> Generator[Pending, None, T]:
        yield Done()  # the first step only starts the operation: its turn has come
        return function(*args, **kwargs)

    steps.__name__ = getattr(function, "__name__", "steps")
    steps.__doc__ = function.__doc__
    return steps


_ALL = frozenset(OPS)
BUILT_IN: tuple[Implementation, ...] = (
    Implementation(
        "mpi",
        "mpx.collectives.impl.mpi",
        _ALL,
        frozenset({"cpu", "cuda-aware"}),
        summary="the MPI library's own collectives (and every op's CPU fallback)",
    ),
    Implementation(
        "ring",
        "mpx.collectives.impl.ring",
        frozenset({"allreduce", "broadcast", "allgather", "reduce_scatter"}),
        frozenset({"cpu"}),
        summary="chunked ring/tree on MPI point-to-point (TorchMPI's direct)",
    ),
    Implementation(
        "shm",
        "mpx.collectives.impl.shm",
        frozenset({"allreduce", "broadcast", "allgather"}),
        frozenset({"cpu"}),
        layout="one node",
        summary="reduce-scatter and allgather straight in the node's shared memory",
    ),
    Implementation(
        "hier",
        "mpx.collectives.impl.hier",
        frozenset({"allreduce", "broadcast"}),
        frozenset({"cpu"}),
        layout="several nodes",
        summary="within nodes (shm), across node leaders (ring/mpi), back within nodes",
    ),
    Implementation(
        "staged",
        "mpx.collectives.impl.staged",
        _ALL - {"barrier"},
        frozenset({"cuda"}),
        summary="CUDA tensors through pinned host buffers, pipelined with the host algorithm",
    ),
    Implementation(
        "ipc",
        "mpx.collectives.impl.ipc",
        frozenset({"allreduce", "broadcast"}),
        frozenset({"cuda"}),
        layout="one node",
        # auto takes it (policy's ipc>=large) where every rank sees the same GPUs
        # (gpus_shared): else a peer's memory cannot be mapped; name it then.
        summary="CUDA IPC handles within a node, reduced on the GPU",
    ),
    Implementation(
        "gloo",
        "mpx.collectives.impl.c10d",
        frozenset({"allreduce", "broadcast", "reduce", "allgather", "alltoall"}),
        frozenset({"cpu"}),
        automatic=False,
        attribute="GLOO",
        summary="torch's ProcessGroupGloo over the same ranks, to compare with",
    ),
    Implementation(
        "nccl",
        "mpx.collectives.impl.c10d",
        frozenset({"allreduce", "broadcast", "reduce", "allgather", "alltoall"}),
        frozenset({"cuda"}),
        automatic=False,
        attribute="NCCL",
        summary="torch's ProcessGroupNCCL over the same ranks, to compare with",
    ),
)
"""The implementations mpx-collectives brings."""

_registry: dict[str, Implementation] = {impl.name: impl for impl in BUILT_IN}
_loaded = [False]


def _load_entry_points() -> None:
    """Adds the implementations other packages register (once per process)."""
    if _loaded[0]:
        return
    _loaded[0] = True
    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        found = entry.load()
        if not isinstance(found, Implementation):
            raise RegistryError(
                f"entry point {entry.name} = {entry.value} ({ENTRY_POINT_GROUP}) is a "
                f"{type(found).__name__}, not an mpx.collectives.core.registry.Implementation"
            )
        if found.name in _registry and _registry[found.name] is not found:
            raise RegistryError(
                f"two implementations are named {found.name!r}: {_registry[found.name].module} "
                f"and {found.module} (entry point {entry.value}); uninstall one"
            )
        _registry[found.name] = found


def get(name: str) -> Implementation:
    """The implementation called ``name``.

    Raises:
        RegistryError: no implementation has that name (the message lists them).
    """
    found = _registry.get(name)
    if found is None:
        _load_entry_points()
        found = _registry.get(name)
    if found is None:
        raise RegistryError(
            f"impl must be 'auto' or one of {', '.join(all_implementations())}, got {name!r} "
            f"(from impl= or MPX_COLLECTIVES_IMPL; other packages add implementations "
            f"through the {ENTRY_POINT_GROUP!r} entry points, e.g. 'cgx' from mpx-quantize)"
        )
    return found


def all_implementations() -> Mapping[str, Implementation]:
    """Every implementation by name: the built-in ones, then those of other packages."""
    _load_entry_points()
    return dict(_registry)
