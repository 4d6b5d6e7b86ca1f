"""The collective operations on torch tensors.

Every operation takes ``comm=`` (default :func:`world`), ``impl=`` (default
``MPX_COLLECTIVES_IMPL`` or ``"auto"``), ``async_op=`` (return a
:class:`Handle` instead of the result) and ``timeout=`` seconds (default
``MPX_TIMEOUT``; a :class:`CollectiveTimeout` instead of a hang). In-place
operations return their input tensor.

With ``MPX_CHECK=1`` every call first compares shape, dtype, op and root
across the ranks and raises :class:`MismatchError` on all of them.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx.collectives import fast_path
from mpx.collectives.checks import check_rank, check_tensor
from mpx.collectives.communicator import Communicator, world
from mpx.collectives.dtypes import check_op_for_dtype
from mpx.collectives.policy import choose
from mpx.collectives.policy import current as current_policy

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


def bytes_communicated() -> int:
    """Bytes of the tensors this process has handed to mpx operations so far.

    The payload, whatever the algorithm moves on the wire: an allreduce of a
    4 MiB tensor counts 4 MiB (a ring sends 2(P-1)/P of it; a quantized
    allreduce hands over its compressed buffers, and those are what count).

    Example::

        before = bytes_communicated(); train_one_epoch()
        print(bytes_communicated() - before)
    """
    return _payload[0]


def _run(
    op: str,
    comm: Communicator | None,
    t: torch.Tensor | None,
    impl: str | None,
    async_op: bool,
    timeout: float | None,
    *args: Any,
    reduce_op: str = "",
    root: int = -1,
) -> Any:
    comm = world() if comm is None else comm
    nbytes = 0 if t is None else t.numel() * t.element_size()
    # The one decision of this call: the policy is consulted here, once.
    choice = choose(op, t is not None and t.is_cuda, nbytes, comm, impl)
    _payload[0] += nbytes
    if current_policy().check:
        comm.check_signature(op, t, reduce_op, root, timeout)
    steps = getattr(choice.module, op)(comm, *(() if t is None else (t,)), *args)
    return comm.run(op, choice.name, steps, async_op, timeout)


def allreduce(
    t: torch.Tensor,
    op: str = "sum",
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Reduces ``t`` across ranks, in place: every rank ends with the result.

    Args:
        t: a contiguous CPU tensor (CUDA with a CUDA-aware MPI).
        op: ``"sum"``, ``"avg"``, ``"max"``, ``"min"`` or ``"prod"``.

    Returns:
        ``t``, or a :class:`Handle` whose ``wait()`` returns it.

    Example::

        grad = allreduce(grad, "avg")
        handle = allreduce(buf, async_op=True); ...; handle.wait(timeout=60)
    """
    if not async_op and timeout is None and fast_path.allreduce(t, op, comm, impl):
        _payload[0] += t.nbytes
        return t
    check_tensor(t, "allreduce")
    check_op_for_dtype(op, t.dtype)
    return _run("allreduce", comm, t, impl, async_op, timeout, op, reduce_op=op)


def broadcast(
    t: torch.Tensor,
    root: int = 0,
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Copies ``root``'s ``t`` into ``t`` on every rank, in place."""
    if not async_op and timeout is None and fast_path.broadcast(t, root, comm, impl):
        _payload[0] += t.nbytes
        return t
    check_tensor(t, "broadcast")
    size = (world() if comm is None else comm).size
    check_rank(root, size, "root", "broadcast")
    return _run("broadcast", comm, t, impl, async_op, timeout, root, root=root)


def reduce(
    t: torch.Tensor,
    root: int = 0,
    op: str = "sum",
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Reduces ``t`` into ``root``'s ``t``; the other ranks' tensors are unchanged."""
    check_tensor(t, "reduce")
    check_op_for_dtype(op, t.dtype)
    size = (world() if comm is None else comm).size
    check_rank(root, size, "root", "reduce")
    return _run("reduce", comm, t, impl, async_op, timeout, root, op, reduce_op=op, root=root)


def allgather(
    t: torch.Tensor,
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Every rank's ``t``, stacked: a new tensor of shape ``(size, *t.shape)``."""
    check_tensor(t, "allgather")
    return _run("allgather", comm, t, impl, async_op, timeout)


def reduce_scatter(
    t: torch.Tensor,
    op: str = "sum",
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Reduces ``t`` across ranks; rank r gets block r of the rows.

    ``t.shape[0]`` must be divisible by the number of ranks; the result has
    ``t.shape[0] // size`` rows (``t`` itself is left unchanged).
    """
    check_tensor(t, "reduce_scatter")
    check_op_for_dtype(op, t.dtype)
    size = (world() if comm is None else comm).size
    if t.dim() == 0 or t.shape[0] % size:
        raise ValueError(
            f"reduce_scatter: the first dimension of shape {tuple(t.shape)} must be divisible "
            f"by the {size} ranks; pad it, or reshape to ({size}, -1)"
        )
    return _run("reduce_scatter", comm, t, impl, async_op, timeout, op, reduce_op=op)


def alltoall(
    t: torch.Tensor,
    *,
    comm: Communicator | None = None,
    impl: str | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Block j of ``t``'s rows goes to rank j; returns the blocks received, in rank order."""
    check_tensor(t, "alltoall")
    size = (world() if comm is None else comm).size
    if t.dim() == 0 or t.shape[0] % size:
        raise ValueError(
            f"alltoall: the first dimension of shape {tuple(t.shape)} must be divisible by "
            f"the {size} ranks"
        )
    return _run("alltoall", comm, t, impl, async_op, timeout)


def send(
    t: torch.Tensor,
    dest: int,
    tag: int = 0,
    *,
    comm: Communicator | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Sends ``t`` to rank ``dest`` (point to point, through MPI)."""
    return _point_to_point("send", t, dest, "dest", tag, comm, async_op, timeout)


def recv(
    t: torch.Tensor,
    source: int,
    tag: int = 0,
    *,
    comm: Communicator | None = None,
    async_op: bool = False,
    timeout: float | None = None,
) -> Any:
    """Receives into ``t`` from rank ``source``; returns ``t``."""
    return _point_to_point("recv", t, source, "source", tag, comm, async_op, timeout)


def _point_to_point(
    op: str,
    t: torch.Tensor,
    peer: int,
    what: str,
    tag: int,
    comm: Communicator | None,
    async_op: bool,
    timeout: float | None,
) -> Any:
    check_tensor(t, op)
    check_rank(peer, (world() if comm is None else comm).size, what, op)
    return _run(op, comm, t, None, async_op, timeout, peer, tag)


def barrier(
    *, comm: Communicator | None = None, async_op: bool = False, timeout: float | None = None
) -> Any:
    """Waits until every rank has called ``barrier``."""
    return _run("barrier", comm, None, None, async_op, timeout)
