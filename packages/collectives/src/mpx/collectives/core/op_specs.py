"""The operations: one table of what each op is (its spec), for all that treats them alike.

:data:`OP_SPECS` is the one declaration of the ops: the functional API
(:mod:`mpx.collectives.core.ops`, generated from it by
:mod:`mpx.collectives.core.ops_source`), the dispatch of a call
(:mod:`mpx.collectives.core.dispatch`), the cross-rank check of calls
(:mod:`mpx.collectives.core.consistency`), the communicator's queue and the
implementations' declarations (:mod:`mpx.collectives.core.registry`, which
checks an implementation provides only ops named here) all read it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["OPS", "OP_SPECS", "OpSpec"]


@dataclass(frozen=True)
class OpSpec:
    """What one operation is, for everything that must treat the ops alike.

    Attributes:
        name: the functional API's name (``mpx.collectives.<name>``).
        c10d: the torch.distributed ``ProcessGroup`` method it backs.
        ordered: matched across ranks by call order (a collective): it takes
            its turn in the communicator's queue, and ``MPX_CHECK`` compares
            it. Point-to-point calls match by source and tag instead.
        in_place: returns (and writes) its input tensor.
        reduces: takes a reduce op (compared by the check).
        rooted: takes a root rank (compared by the check).
        tensor: takes a tensor (barrier does not).
        policy: the policy chooses among implementations for it; False: MPI
            (through pinned memory for CUDA tensors) always runs it. The
            functional API takes ``impl=`` exactly where this is True.
        params: the functional API's own parameters after the tensor, in
            order, as ``(name, annotation, default)`` (``default`` as source,
            ``""`` for a required one). The names say what is checked before
            dispatch: ``op`` against the dtype, ``root``/``dest``/``source``
            as a rank of the communicator.
        result: what a blocking call returns (``"torch.Tensor"``, ``"None"``);
            ``async_op=True`` returns a ``Handle`` of it.
        scalar: also takes a Python int or float (blocking; the same type comes back).
        fast: small blocking CPU calls try ``fast_path.<name>`` first.
        rows_per_rank: the tensor's first dimension must divide by the number of ranks.
        doc: the functional API's docstring.

    ``mpx.collectives.core.ops`` is generated from these (``ops_source``): each
    op's signature, its overloads (the ``async_op``-dependent return type) and
    the arguments its one shared body validates.
    """

    name: str
    c10d: str
    ordered: bool = True
    in_place: bool = False
    reduces: bool = False
    rooted: bool = False
    tensor: bool = True
    policy: bool = True
    params: tuple[tuple[str, str, str], ...] = ()
    result: str = "torch.Tensor"
    scalar: bool = False
    fast: bool = False
    rows_per_rank: bool = False
    doc: str = ""


_OP = ("op", "str", '"sum"')
_ROOT = ("root", "int", "0")
_TAG = ("tag", "int", "0")

OP_SPECS: Mapping[str, OpSpec] = {
    spec.name: spec
    for spec in (
        OpSpec(
            "allreduce",
            "allreduce",
            in_place=True,
            reduces=True,
            params=(_OP,),
            scalar=True,
            fast=True,
            doc="""Reduces ``t`` across ranks, in place: every rank ends with the result.

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
    """,
        ),
        OpSpec(
            "broadcast",
            "broadcast",
            in_place=True,
            rooted=True,
            params=(_ROOT,),
            scalar=True,
            fast=True,
            doc="""Copies ``root``'s ``t`` into ``t`` on every rank, in place.

    A Python int or float (TorchMPI's scalar broadcast) comes back as root's
    value, of the same type.
    """,
        ),
        OpSpec(
            "reduce",
            "reduce",
            in_place=True,
            reduces=True,
            rooted=True,
            params=(_ROOT, _OP),
            doc="Reduces ``t`` into ``root``'s ``t``; the other ranks' tensors are unchanged.",
        ),
        OpSpec(
            "allgather",
            "allgather",
            doc="Every rank's ``t``, stacked: a new tensor of shape ``(size, *t.shape)``.",
        ),
        OpSpec(
            "reduce_scatter",
            "reduce_scatter",
            reduces=True,
            params=(_OP,),
            rows_per_rank=True,
            doc="""Reduces ``t`` across ranks; rank r gets block r of the rows.

    ``t.shape[0]`` must be divisible by the number of ranks; the result has
    ``t.shape[0] // size`` rows (``t`` itself is left unchanged).
    """,
        ),
        OpSpec(
            "alltoall",
            "alltoall_base",
            rows_per_rank=True,
            doc=(
                "Block j of ``t``'s rows goes to rank j; returns the blocks received, "
                "in rank order."
            ),
        ),
        OpSpec(
            "send",
            "send",
            ordered=False,
            policy=False,
            params=(("dest", "int", ""), _TAG),
            result="None",
            doc="Sends ``t`` to rank ``dest`` (point to point, through MPI).",
        ),
        OpSpec(
            "recv",
            "recv",
            ordered=False,
            in_place=True,
            policy=False,
            params=(("source", "int", ""), _TAG),
            doc="Receives into ``t`` from rank ``source``; returns ``t``.",
        ),
        OpSpec(
            "barrier",
            "barrier",
            tensor=False,
            policy=False,
            result="None",
            doc="Waits until every rank has called ``barrier``.",
        ),
    )
}
"""Every operation, in the functional API's order: the one table of op specs."""

OPS = tuple(OP_SPECS)
"""Every operation's name, in the order of the functional API."""
