"""The collective operations on torch tensors.

Every operation takes ``comm=`` (default :func:`world`), ``impl=`` (default
``MPX_COLLECTIVES_IMPL`` or ``"auto"``), ``async_op=`` (return a
:class:`Handle` instead of the result) and ``timeout=`` seconds (default
``MPX_TIMEOUT``; a :class:`CollectiveTimeout` instead of a hang; > 0, or
``math.inf`` for none: 0, negative or NaN is refused before anything moves).
In-place operations return their input tensor.

Each operation is written once, in the table of op specs
(:data:`mpx.collectives.registry.OP_SPECS`): its signature and overloads are
generated from it (:mod:`mpx.collectives.ops_source`, the section between the
markers below), and its body is one call of :func:`_call`, which validates the
arguments its spec names and dispatches, the same way for every op.

Ranks that make different calls get :class:`MismatchError` on every rank,
before any data moves, naming the field that differs and every rank's call:
every collective call is compared across ranks (``MPX_CHECK=auto``, on the
node's shared-memory call board; ``1`` through MPI; ``0`` none; see
:mod:`mpx.collectives.consistency`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeVar, cast, overload

import torch

from mpx.collectives import fast_path
from mpx.collectives.checks import check_rank, check_tensor, check_timeout
from mpx.collectives.communicator import CommLike, as_communicator
from mpx.collectives.dtypes import check_op_for_dtype
from mpx.collectives.errors import MPXTypeError, MPXValueError
from mpx.collectives.handle import Handle, Steps
from mpx.collectives.policy import choose
from mpx.collectives.registry import OP_SPECS, OpSpec
from mpx.collectives.registry import get as implementation

__all__ = [
    "allgather",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "bytes_communicated",
    "recv",
    "reduce",
    "reduce_scatter",
    "send",
]


_payload = [0]  # bytes of tensors handed to operations by this process

Scalar = TypeVar("Scalar", int, float)


def _scalar_tensor(value: object, op: str, async_op: bool) -> torch.Tensor | None:
    """A Python int/float as a one-element tensor (TorchMPI's scalar collectives), else None.

    int travels as int64 and float as float64, so the value comes back
    exactly as another rank's Python arithmetic would give it.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if async_op:
        raise MPXTypeError(
            f"{op}: a Python {type(value).__name__} ({value!r}) is reduced blocking only; "
            "for async_op=True pass a tensor, e.g. torch.tensor([value])"
        )
    return torch.tensor([value], dtype=torch.int64 if isinstance(value, int) else torch.float64)


def _scalar_result(tensor: torch.Tensor, value: Scalar) -> Scalar:
    return type(value)(tensor.item())


def bytes_communicated() -> int:
    """Bytes of the tensors this process has handed to mpx operations so far.

    The payload, whatever the algorithm moves on the wire: an allreduce of a
    4 MiB tensor counts 4 MiB (a ring sends 2(P-1)/P of it; a quantized
    allreduce hands over its compressed buffers, and those are what count).

    Example::

        before = bytes_communicated(); train_one_epoch()
        print(bytes_communicated() - before)
    """
    return _payload[0] + fast_path.payload()


def _run(
    op: str,
    comm: CommLike | None,
    t: torch.Tensor | None,
    impl: str | None,
    async_op: bool,
    timeout: float | None,
    *args: Any,
    reduce_op: str = "",
    root: int = -1,
) -> Any:
    comm = as_communicator(comm)
    nbytes = 0 if t is None else t.numel() * t.element_size()
    # The one decision of this call: the policy is consulted here, once, and
    # picks among the implementations whose declarations accept the call.
    name = choose(
        op,
        t is not None and t.is_cuda,
        nbytes,
        comm,
        impl,
        None if t is None else t.dtype,
        reduce_op,
    )
    chosen = implementation(name)
    _payload[0] += nbytes
    # Autograd as on gloo, whatever the implementation: a collective works on
    # the tensor's memory and is not recorded by autograd (no grad_fn, the
    # version counter untouched, outputs that do not require grad). Every
    # implementation declaring requires_grad="detached" (all built-in ones)
    # gets that memory as a tensor without autograd (``.data``) -- before,
    # MPI's path bypassed autograd while shm's out= kernels and a broadcast
    # into a Parameter raised on one rank and hung the others. One declaring
    # "as is" records autograd itself and gets the caller's tensor.
    work = t.data if t is not None and t.requires_grad and not chosen.takes_autograd else t
    steps = chosen.function(op)(comm, *(() if work is None else (work,)), *args)
    if work is not None and work is not t:
        steps = _returning_input(steps, work, t)
    check = comm.check_steps(op, t, reduce_op, root)
    if check is not None:
        steps = _checked(check, steps)
    return comm.run(op, name, steps, async_op, timeout)


def _returning_input(steps: Steps[Any], work: torch.Tensor, t: Any) -> Steps[Any]:
    """The steps, returning the caller's tensor where an in-place op returns its memory."""
    result = yield from steps
    return t if result is work else result


def _checked(check: Steps[None], steps: Steps[Any]) -> Steps[Any]:
    """The call's steps after its consistency check's (``MPX_CHECK``), as one operation."""
    try:
        yield from check
    except BaseException:
        steps.close()  # never started: nothing of the data moved
        raise
    return (yield from steps)


@dataclass(frozen=True)
class _Plan:
    """What :func:`_call` checks and passes on for one op, read off its spec once.

    ``op``: the index of the reduce op among the op's own arguments (-1: none);
    ``ranks``: (index, name) of the arguments that must be a rank (root, dest,
    source); ``root``: the index of the root (-1: none).
    """

    spec: OpSpec
    op: int
    ranks: tuple[tuple[int, str], ...]
    root: int

    @classmethod
    def of(cls, spec: OpSpec) -> _Plan:
        names = [name for name, _, _ in spec.params]
        return cls(
            spec,
            names.index("op") if "op" in names else -1,
            tuple((i, n) for i, n in enumerate(names) if n in ("root", "dest", "source")),
            names.index("root") if "root" in names else -1,
        )


_PLANS = {name: _Plan.of(spec) for name, spec in OP_SPECS.items()}


def _call(
    plan: _Plan,
    comm: CommLike | None,
    impl: str | None,
    async_op: bool,
    timeout: float | None,
    t: Any,
    *args: Any,
) -> Any:
    """Every operation's body: a Python number, the arguments' checks, then :func:`_run`.

    ``args`` are the op's own arguments, in the order of its spec's ``params``.
    """
    spec = plan.spec
    name = spec.name
    timeout = check_timeout(timeout, name)
    if spec.scalar:
        scalar = _scalar_tensor(t, name, async_op)
        if scalar is not None:
            if timeout is None and getattr(fast_path, name)(scalar, *args, comm, impl):
                return _scalar_result(scalar, t)
            _call(plan, comm, impl, False, timeout, scalar, *args)
            return _scalar_result(scalar, t)
    if spec.tensor:
        check_tensor(t, name)
    if plan.op >= 0:
        check_op_for_dtype(args[plan.op], t.dtype)
    if plan.ranks or spec.rows_per_rank:
        size = as_communicator(comm).size
        for index, what in plan.ranks:
            check_rank(args[index], size, what, name)
        if spec.rows_per_rank and (t.dim() == 0 or t.shape[0] % size):
            raise MPXValueError(
                f"{name}: the first dimension of shape {tuple(t.shape)} must be divisible "
                f"by the {size} ranks; pad it, or reshape to ({size}, -1)"
            )
    return _run(
        name,
        comm,
        t,
        impl,
        async_op,
        timeout,
        *args,
        reduce_op=args[plan.op] if plan.op >= 0 and spec.reduces else "",
        root=args[plan.root] if plan.root >= 0 else -1,
    )


# --- generated by mpx.collectives.ops_source from registry.OP_SPECS: do not edit ---


@overload
def allreduce(
    t: Scalar,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> Scalar: ...


@overload
def allreduce(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def allreduce(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def allreduce(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def allreduce(
    t: torch.Tensor | Scalar,
    op: str = "sum",
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor] | Scalar:
    """Reduces ``t`` across ranks, in place: every rank ends with the result.

    Args:
        t: a contiguous tensor, or a Python int or float (TorchMPI's scalar
            allreduce: blocking, the result comes back as the same type).
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``. ``max``
            and ``min`` give NaN wherever any rank has NaN, on every rank and
            implementation but torch's own ``impl="gloo"`` and ``"nccl"``.

    Returns:
        ``t``, or a :class:`Handle` whose ``wait()`` returns it; for a
        Python number, the reduced number.

    Example::

        grad = allreduce(grad, "avg")
        handle = allreduce(buf, async_op=True); ...; handle.wait(timeout=60)
        total = allreduce(local_count)   # an int in, the sum over ranks out
    """
    if not async_op and timeout is None and fast_path.allreduce(t, op, comm, impl):
        return t
    return cast(
        "torch.Tensor | Handle[torch.Tensor] | Scalar",
        _call(_PLANS["allreduce"], comm, impl, async_op, timeout, t, op),
    )


@overload
def broadcast(
    t: Scalar,
    root: int = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> Scalar: ...


@overload
def broadcast(
    t: torch.Tensor,
    root: int = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def broadcast(
    t: torch.Tensor,
    root: int = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def broadcast(
    t: torch.Tensor,
    root: int = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def broadcast(
    t: torch.Tensor | Scalar,
    root: int = 0,
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor] | Scalar:
    """Copies ``root``'s ``t`` into ``t`` on every rank, in place.

    A Python int or float (TorchMPI's scalar broadcast) comes back as root's
    value, of the same type.
    """
    if not async_op and timeout is None and fast_path.broadcast(t, root, comm, impl):
        return t
    return cast(
        "torch.Tensor | Handle[torch.Tensor] | Scalar",
        _call(_PLANS["broadcast"], comm, impl, async_op, timeout, t, root),
    )


@overload
def reduce(
    t: torch.Tensor,
    root: int = ...,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def reduce(
    t: torch.Tensor,
    root: int = ...,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def reduce(
    t: torch.Tensor,
    root: int = ...,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def reduce(
    t: torch.Tensor,
    root: int = 0,
    op: str = "sum",
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduces ``t`` into ``root``'s ``t``; the other ranks' tensors are unchanged."""
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _call(_PLANS["reduce"], comm, impl, async_op, timeout, t, root, op),
    )


@overload
def allgather(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def allgather(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def allgather(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def allgather(
    t: torch.Tensor,
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Every rank's ``t``, stacked: a new tensor of shape ``(size, *t.shape)``."""
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _call(_PLANS["allgather"], comm, impl, async_op, timeout, t),
    )


@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def reduce_scatter(
    t: torch.Tensor,
    op: str = ...,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def reduce_scatter(
    t: torch.Tensor,
    op: str = "sum",
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Reduces ``t`` across ranks; rank r gets block r of the rows.

    ``t.shape[0]`` must be divisible by the number of ranks; the result has
    ``t.shape[0] // size`` rows (``t`` itself is left unchanged).
    """
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _call(_PLANS["reduce_scatter"], comm, impl, async_op, timeout, t, op),
    )


@overload
def alltoall(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def alltoall(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def alltoall(
    t: torch.Tensor,
    *,
    comm: CommLike | None = ...,
    impl: str | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def alltoall(
    t: torch.Tensor,
    *,
    comm: CommLike | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Block j of ``t``'s rows goes to rank j; returns the blocks received, in rank order."""
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _call(_PLANS["alltoall"], comm, impl, async_op, timeout, t),
    )


@overload
def send(
    t: torch.Tensor,
    dest: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> None: ...


@overload
def send(
    t: torch.Tensor,
    dest: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[None]: ...


@overload
def send(
    t: torch.Tensor,
    dest: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> Handle[None] | None: ...


def send(
    t: torch.Tensor,
    dest: int,
    tag: int = 0,
    *,
    comm: CommLike | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Handle[None] | None:
    """Sends ``t`` to rank ``dest`` (point to point, through MPI)."""
    return cast(
        "Handle[None] | None", _call(_PLANS["send"], comm, None, async_op, timeout, t, dest, tag)
    )


@overload
def recv(
    t: torch.Tensor,
    source: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> torch.Tensor: ...


@overload
def recv(
    t: torch.Tensor,
    source: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[torch.Tensor]: ...


@overload
def recv(
    t: torch.Tensor,
    source: int,
    tag: int = ...,
    *,
    comm: CommLike | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> torch.Tensor | Handle[torch.Tensor]: ...


def recv(
    t: torch.Tensor,
    source: int,
    tag: int = 0,
    *,
    comm: CommLike | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> torch.Tensor | Handle[torch.Tensor]:
    """Receives into ``t`` from rank ``source``; returns ``t``."""
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _call(_PLANS["recv"], comm, None, async_op, timeout, t, source, tag),
    )


@overload
def barrier(
    *,
    comm: CommLike | None = ...,
    async_op: Literal[False] = ...,
    timeout: float | None = ...,
) -> None: ...


@overload
def barrier(
    *,
    comm: CommLike | None = ...,
    async_op: Literal[True],
    timeout: float | None = ...,
) -> Handle[None]: ...


@overload
def barrier(
    *,
    comm: CommLike | None = ...,
    async_op: bool,
    timeout: float | None = ...,
) -> Handle[None] | None: ...


def barrier(
    *,
    comm: CommLike | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Handle[None] | None:
    """Waits until every rank has called ``barrier``."""
    return cast(
        "Handle[None] | None", _call(_PLANS["barrier"], comm, None, async_op, timeout, None)
    )


# --- end of the generated operations ---
