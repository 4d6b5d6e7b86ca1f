"""Every operation's one body: its arguments checked, the policy's choice, autograd, the check.

The public operations (:mod:`mpx.collectives.core.ops`, generated from
:data:`mpx.collectives.core.op_specs.OP_SPECS`) each make one call of :func:`call`
with their op's :class:`Plan`, the same way for every op::

    call(PLANS["allreduce"], comm, impl, async_op, timeout, t, op)
      a Python number?        as a one-element tensor (TorchMPI's scalar collectives)
      check_tensor, op, ranks what the op's spec names, before anything moves
      policy.choose           the implementation (once per call)
      t.data                  autograd as on gloo (unless the implementation records it)
      comm.check_steps        the cross-rank check first (MPX_CHECK), then the op's steps
      comm.run                a result, or a Handle (async_op=True)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from mpx.collectives.base import (
    MPXTypeError,
    MPXValueError,
    Steps,
    check_op_for_dtype,
    check_rank,
    check_tensor,
    check_timeout,
    writable,
)
from mpx.collectives.core import fast_path
from mpx.collectives.core.communicator import CommLike, as_communicator
from mpx.collectives.core.op_specs import OP_SPECS, OpSpec
from mpx.collectives.core.policy import choose
from mpx.collectives.core.registry import get as implementation

__all__ = ["PLANS", "Plan", "Scalar", "bytes_communicated", "call"]


_payload = [0]  # bytes of tensors handed to operations by this process

Scalar = TypeVar("Scalar", int, float)
"""A Python number the scalar collectives take and give back (int or float)."""


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


def count_payload(nbytes: int) -> None:
    """Adds to :func:`bytes_communicated` what a caller handed to MPI itself (the channel's
    CPU messages, :mod:`mpx.collectives.p2p.channel_wire`)."""
    _payload[0] += nbytes


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
    if work is not None:
        # An inference tensor used after its inference_mode: implementations that
        # write with torch (16-bit results, an AVG's division) get a writable alias.
        work = writable(work)
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
class Plan:
    """What :func:`call` checks and passes on for one op, read off its spec once.

    ``op``: the index of the reduce op among the op's own arguments (-1: none);
    ``ranks``: (index, name) of the arguments that must be a rank (root, dest,
    source); ``root``: the index of the root (-1: none).
    """

    spec: OpSpec
    op: int
    ranks: tuple[tuple[int, str], ...]
    root: int

    @classmethod
    def of(cls, spec: OpSpec) -> Plan:
        names = [name for name, _, _ in spec.params]
        return cls(
            spec,
            names.index("op") if "op" in names else -1,
            tuple((i, n) for i, n in enumerate(names) if n in ("root", "dest", "source")),
            names.index("root") if "root" in names else -1,
        )


PLANS = {name: Plan.of(spec) for name, spec in OP_SPECS.items()}


def call(
    plan: Plan,
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
            call(plan, comm, impl, False, timeout, scalar, *args)
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
