"""The collective operations on torch tensors.

Every operation takes ``comm=`` (default :func:`world`), ``impl=`` (default
``MPX_COLLECTIVES_IMPL`` or ``"auto"``), ``async_op=`` (return a
:class:`Handle` instead of the result) and ``timeout=`` seconds (default
``MPX_TIMEOUT``; a :class:`CollectiveTimeout` instead of a hang). In-place
operations return their input tensor.

Ranks that make different calls get :class:`MismatchError` on every rank,
before any data moves, naming the field that differs and every rank's call:
every collective call is compared across ranks (``MPX_CHECK=auto``, on the
node's shared-memory call board; ``1`` through MPI; ``0`` none; see
:mod:`mpx.collectives.consistency`).
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar, cast, overload

import torch

from mpx.collectives import fast_path
from mpx.collectives.checks import check_rank, check_tensor
from mpx.collectives.communicator import CommLike, as_communicator
from mpx.collectives.dtypes import check_op_for_dtype
from mpx.collectives.errors import MPXTypeError, MPXValueError
from mpx.collectives.handle import Handle, Steps
from mpx.collectives.policy import choose
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
    # The one decision of this call: the policy is consulted here, once.
    name = choose(op, t is not None and t.is_cuda, nbytes, comm, impl)
    _payload[0] += nbytes
    # Autograd as on gloo, whatever the implementation: a collective works on
    # the tensor's memory and is not recorded by autograd (no grad_fn, the
    # version counter untouched, outputs that do not require grad). Every
    # implementation gets that memory as a tensor without autograd (``.data``)
    # -- before, MPI's path bypassed autograd while shm's out= kernels and a
    # broadcast into a Parameter raised on one rank and hung the others.
    work = t.data if t is not None and t.requires_grad else t
    steps = implementation(name).function(op)(comm, *(() if work is None else (work,)), *args)
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
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.

    Returns:
        ``t``, or a :class:`Handle` whose ``wait()`` returns it; for a
        Python number, the reduced number.

    Example::

        grad = allreduce(grad, "avg")
        handle = allreduce(buf, async_op=True); ...; handle.wait(timeout=60)
        total = allreduce(local_count)   # an int in, the sum over ranks out
    """
    scalar = _scalar_tensor(t, "allreduce", async_op)
    if scalar is not None:
        assert isinstance(t, int | float)
        return _scalar_result(allreduce(scalar, op, comm=comm, impl=impl, timeout=timeout), t)
    t = cast(torch.Tensor, t)  # or anything else: check_tensor names it
    if not async_op and timeout is None and fast_path.allreduce(t, op, comm, impl):
        return t
    check_tensor(t, "allreduce")
    check_op_for_dtype(op, t.dtype)
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _run("allreduce", comm, t, impl, async_op, timeout, op, reduce_op=op),
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
    scalar = _scalar_tensor(t, "broadcast", async_op)
    if scalar is not None:
        assert isinstance(t, int | float)
        return _scalar_result(broadcast(scalar, root, comm=comm, impl=impl, timeout=timeout), t)
    t = cast(torch.Tensor, t)  # or anything else: check_tensor names it
    if not async_op and timeout is None and fast_path.broadcast(t, root, comm, impl):
        return t
    check_tensor(t, "broadcast")
    size = as_communicator(comm).size
    check_rank(root, size, "root", "broadcast")
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _run("broadcast", comm, t, impl, async_op, timeout, root, root=root),
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
    check_tensor(t, "reduce")
    check_op_for_dtype(op, t.dtype)
    size = as_communicator(comm).size
    check_rank(root, size, "root", "reduce")
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _run("reduce", comm, t, impl, async_op, timeout, root, op, reduce_op=op, root=root),
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
    check_tensor(t, "allgather")
    return cast(
        "torch.Tensor | Handle[torch.Tensor]", _run("allgather", comm, t, impl, async_op, timeout)
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
    check_tensor(t, "reduce_scatter")
    check_op_for_dtype(op, t.dtype)
    size = as_communicator(comm).size
    if t.dim() == 0 or t.shape[0] % size:
        raise MPXValueError(
            f"reduce_scatter: the first dimension of shape {tuple(t.shape)} must be divisible "
            f"by the {size} ranks; pad it, or reshape to ({size}, -1)"
        )
    return cast(
        "torch.Tensor | Handle[torch.Tensor]",
        _run("reduce_scatter", comm, t, impl, async_op, timeout, op, reduce_op=op),
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
    check_tensor(t, "alltoall")
    size = as_communicator(comm).size
    if t.dim() == 0 or t.shape[0] % size:
        raise MPXValueError(
            f"alltoall: the first dimension of shape {tuple(t.shape)} must be divisible by "
            f"the {size} ranks; pad it, or reshape to ({size}, -1)"
        )
    return cast(
        "torch.Tensor | Handle[torch.Tensor]", _run("alltoall", comm, t, impl, async_op, timeout)
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
        "Handle[None] | None",
        _point_to_point("send", t, dest, "dest", tag, comm, async_op, timeout),
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
        _point_to_point("recv", t, source, "source", tag, comm, async_op, timeout),
    )


def _point_to_point(
    op: str,
    t: torch.Tensor,
    peer: int,
    what: str,
    tag: int,
    comm: CommLike | None,
    async_op: bool,
    timeout: float | None,
) -> Any:
    check_tensor(t, op)
    check_rank(peer, as_communicator(comm).size, what, op)
    return _run(op, comm, t, None, async_op, timeout, peer, tag)


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
    *, comm: CommLike | None = None, async_op: bool = False, timeout: float | None = None
) -> Handle[None] | None:
    """Waits until every rank has called ``barrier``."""
    return cast("Handle[None] | None", _run("barrier", comm, None, None, async_op, timeout))
