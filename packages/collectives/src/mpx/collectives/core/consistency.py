"""Cross-rank consistency of collective calls (``MPX_CHECK``), on by default.

MPI matches collectives by their order on a communicator, nothing else: ranks
that pass different dtypes, element counts, reduce ops or roots get garbage,
a truncation error on one rank while another hangs, or a hang. So every
collective call is compared across ranks before any of its data moves::

    MPX_CHECK    every collective call                 on a mismatch
    ---------    -----------------------------------   ---------------------------------
    auto         posts its signature on the call        every rank has seen every row:
    (default)    board (shared memory, one row per      all take part in one more small
                 rank and call) and waits for the       exchange (each rank's call, with
                 peers' rows -- a barrier that          its shape) and raise the same
                 carries the call; across nodes, one    MismatchError; nothing of the
                 small MPI allgather of the rows        call's data has moved
    1            the small MPI allgather on every communicator (shared memory or not)
    0            nothing

Every rank takes part in the same exchange for the same call whatever it has
called before: there is no memory of signatures seen, so a rank cannot skip a
comparison its peers make (the ledger of earlier rounds could: rank 0 returned
garbage while rank 1 raised a garbled error), a mismatch between signatures
each rank has used before is caught at that very call, and the check keeps no
state that grows with the number of shapes. A failed comparison leaves none
behind either: the rows of the next call go to the board's other half, and
the next correct call is correct.

A signature is what MPI matches on: the op, the dtype, the element count, the
reduce op and the root (a shape with the same element count reduces the same
memory, so it is not compared; the error shows each rank's shape). Each field
travels as one int64 (:func:`encode`): names as their index in fixed tables,
so a row is decoded without any cache (``ROW`` int64s).

The cost (``benchmarks/bench_overhead.py``): on one node, a store of the row
and a wait for the peers' rows in shared memory -- the compiled fast path does
it in C -- which is a barrier the collective would otherwise pay in its own
first exchange.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.base import MismatchError, Pending, Requests, Steps, gather_bytes
from mpx.collectives.core.op_specs import OP_SPECS
from mpx.collectives.core.policy import current as current_policy
from mpx.collectives.node import ROW, calls_differ

__all__ = [
    "CHECKED_OPS",
    "Board",
    "Call",
    "Peers",
    "Signature",
    "call_of",
    "compare_steps",
    "config_hash",
    "decode",
    "describe",
    "encode",
    "fields_differ",
    "first_difference",
    "mismatch_steps",
    "sequences_differ",
    "signature_of",
]

MASK = (1 << 63) - 1

# The collectives the check compares (the ordered ops). Point-to-point calls
# (send, recv) differ between peers by design and are matched by tag, not by order.
CHECKED_OPS = frozenset(name for name, spec in OP_SPECS.items() if spec.ordered)

# What Communicator.check_same compares: a configuration, as one row whose op is this.
CONFIGURATION = "configuration"

Signature = tuple[str, str, int, str, int]
"""(op, dtype, element count, reduce op, root): ``""`` and -1 where they do not apply."""

Call = tuple[str, str, tuple[int, ...], str, int]
"""(op, dtype, shape, reduce op, root): a call as errors show it."""

# Fixed tables: a name's code is its index + 1 (0 is "", and never a hash, so
# decoding needs no memory of what was encoded). Every rank runs this module's
# code, so every rank has the same tables.
_OP_NAMES = ("", *sorted(CHECKED_OPS), CONFIGURATION)
_DTYPE_NAMES = (
    "",
    *sorted(
        {str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)}
    ),
)
_REDUCE_NAMES = ("", "sum", "avg", "max", "min", "prod", "band", "bor", "bxor", "premul_sum")
_CODES = [
    {name: i for i, name in enumerate(table)} for table in (_OP_NAMES, _DTYPE_NAMES, _REDUCE_NAMES)
]


def _code(table: int, name: str) -> int:
    found = _CODES[table].get(name)
    if found is None:  # a name outside the tables: its hash, negative (never an index)
        digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
        return -1 - (int.from_bytes(digest, "little") & MASK)
    return found


def _name(table: int, code: int) -> str:
    names = (_OP_NAMES, _DTYPE_NAMES, _REDUCE_NAMES)[table]
    return names[code] if 0 <= code < len(names) else f"<unknown {code:#x}>"


def signature_of(op: str, tensor: torch.Tensor | None, reduce_op: str, root: int) -> Signature:
    """The call as the check compares it: what MPI matches on (:data:`Signature`)."""
    if tensor is None:
        return (op, "", 0, reduce_op, root)
    return (op, str(tensor.dtype).replace("torch.", ""), tensor.numel(), reduce_op, root)


def call_of(op: str, tensor: torch.Tensor | None, reduce_op: str, root: int) -> Call:
    """The call as errors show it (its shape, where the signature has the element count)."""
    if tensor is None:
        return (op, "", (), reduce_op, root)
    return (op, str(tensor.dtype).replace("torch.", ""), tuple(tensor.shape), reduce_op, root)


# Rows of recent signatures (building one costs ~3 us of numpy; a training loop
# repeats a few). Bounded: emptied when full, so shapes that vary every step cost
# at most _ROWS_LIMIT rows (~100 KB).
_ROWS: dict[tuple[Signature, int], np.ndarray] = {}
_ROWS_LIMIT = 1024


def encode(signature: Signature, configuration: int = 0) -> np.ndarray:
    """One call as ``ROW`` int64s: what the ranks compare (read-only: it may be shared)."""
    key = (signature, configuration)
    row = _ROWS.get(key)
    if row is None:
        op, dtype, count, reduce_op, root = signature
        row = np.array(
            [_code(0, op), _code(1, dtype), count, _code(2, reduce_op), root, configuration],
            dtype=np.int64,
        )
        row.flags.writeable = False
        if len(_ROWS) >= _ROWS_LIMIT:
            _ROWS.clear()
        _ROWS[key] = row
    return row


def decode(row: np.ndarray) -> tuple[Signature, int]:
    """Inverse of :func:`encode`: (signature, configuration hash)."""
    op, dtype, count, reduce_op, root, configuration = (int(x) for x in row[:ROW])
    signature = (_name(0, op), _name(1, dtype), count, _name(2, reduce_op), root)
    return signature, configuration


def config_hash(what: str, fields: Mapping[str, Any]) -> int:
    """A 63-bit hash of a configuration, the same in every process (unlike ``hash()``)."""
    text = repr((what, sorted((str(k), repr(v)) for k, v in fields.items())))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & MASK


def _shape(dtype: str, shape: Sequence[int]) -> str:
    return f"{dtype}[{', '.join(str(n) for n in shape)}]"


def describe(call: Call | Signature) -> str:
    """``allreduce(float32[2, 500], op='sum')``: how errors show a call.

    A :data:`Signature` (element count, no shape) shows as ``float32[1000]``.
    """
    op, dtype, shape, reduce_op, root = call
    dims = (shape,) if isinstance(shape, int) else shape
    parts = [_shape(dtype, dims)] if dtype else []
    if reduce_op:
        parts.append(f"op={reduce_op!r}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{op}({', '.join(parts)})"


_FIELDS = ("op", "dtype", "element count", "reduce op", "root")
_SHOWN = 8  # ranks whose calls an error lists one by one


def _compared(call: Call | Signature) -> Signature:
    op, dtype, shape, reduce_op, root = call
    count = shape if isinstance(shape, int) else int(np.prod(shape, dtype=np.int64))
    return (op, dtype, count if dtype else 0, reduce_op, root)


def first_difference(op: str, calls: Sequence[Call | Signature], how: str) -> MismatchError | None:
    """The error for ranks whose calls differ (None if all agree).

    Names the first field that differs, the calls of rank 0 and of the first
    rank that differs from it, e.g. ``allreduce: ranks disagree on dtype:
    rank 0 passed float32[1000], rank 1 float64[1000]``, then every rank's
    call (the first eight).
    """
    signatures = [_compared(c) for c in calls]
    other = next((r for r, s in enumerate(signatures) if s != signatures[0]), None)
    if other is None:
        return None
    mine, theirs = calls[0], calls[other]
    field = next(
        name for name, a, b in zip(_FIELDS, signatures[0], signatures[other], strict=True) if a != b
    )
    differing = [r for r, s in enumerate(signatures) if s != signatures[0]]
    also = f" (ranks differing from rank 0: {differing})" if len(differing) > 1 else ""
    if field == "op":
        what = f"rank 0 called {describe(mine)}, rank {other} {describe(theirs)}"
    elif field == "reduce op":
        what = f"rank 0 passed op={mine[3]!r}, rank {other} op={theirs[3]!r}"
    elif field == "root":
        what = f"rank 0 passed root={mine[4]}, rank {other} root={theirs[4]}"
    else:
        a = _shape(mine[1], (mine[2],) if isinstance(mine[2], int) else mine[2])
        b = _shape(theirs[1], (theirs[2],) if isinstance(theirs[2], int) else theirs[2])
        what = f"rank 0 passed {a}, rank {other} {b}"
    listed = "; ".join(f"rank {r}: {describe(c)}" for r, c in enumerate(calls[:_SHOWN]))
    more = f"; and {len(calls) - _SHOWN} more ranks" if len(calls) > _SHOWN else ""
    return MismatchError(
        f"{op}: ranks disagree on {field}: {what}{also}{how}; every rank must make the "
        "same collective calls in the same order, with the same dtype, element count, "
        f"reduce op and root (calls: {listed}{more})"
    )


def fields_differ(what: str, every: Sequence[Mapping[str, Any]]) -> MismatchError | None:
    """The error for ranks whose configurations (name -> value) differ, or None."""
    first = every[0]
    for rank, fields in enumerate(every):
        if fields == first:
            continue
        names = sorted(set(first) | set(fields))
        name = next(n for n in names if first.get(n) != fields.get(n))
        return MismatchError(
            f"{what}: ranks disagree on {name}: rank 0 passed {first.get(name)!r}, "
            f"rank {rank} {fields.get(name)!r}; every rank must pass the same {name}"
        )
    return None


def sequences_differ(what: str, noun: str, every: Sequence[Sequence[str]]) -> MismatchError | None:
    """The error for ranks whose ordered lists (of parameters, say) differ, or None.

    Names the first position that differs, or the lengths when one list is a
    prefix of the other: ``"<what>: ranks disagree on parameter 3: rank 0 has
    'fc.weight' float32[10, 4], rank 1 'fc.weight' float32[10, 5]"``.
    """
    first = every[0]
    for rank, items in enumerate(every):
        if list(items) == list(first):
            continue
        for i, (a, b) in enumerate(zip(first, items, strict=False)):
            if a != b:
                return MismatchError(
                    f"{what}: ranks disagree on {noun} {i}: rank 0 has {a}, rank {rank} {b}"
                )
        return MismatchError(
            f"{what}: ranks disagree on the number of {noun}s: rank 0 has {len(first)}, "
            f"rank {rank} {len(items)}"
        )
    return None


# -- the comparison, as steps of the call it checks -------------------------------


class Board(Protocol):
    """The call board as the comparison uses it (:class:`~mpx.collectives.node.CallBoard`)."""

    def post(self, row: np.ndarray) -> int: ...
    def arrived(self, number: int) -> bool: ...
    def same(self, number: int) -> bool: ...


class Peers(Protocol):
    """What the comparison needs of a communicator (:class:`mpx.collectives.Communicator`)."""

    @property
    def size(self) -> int: ...
    @property
    def mpi(self) -> MPI.Intracomm: ...
    @property
    def call_board(self) -> Any: ...  # a Board, or None where the ranks share no memory


def compare_steps(
    comm: Peers,
    op: str,
    row: np.ndarray,
    call: Callable[[], Call | Mapping[str, Hashable]],
    arrival: Callable[[Any, int], Pending],
) -> Steps[None]:
    """Steps: every rank's row of this call, compared; a mismatch raises on every rank.

    ``call`` describes this rank's call for the error (a :data:`Call`, or
    a configuration's fields); it is exchanged only after a mismatch,
    which every rank has seen in the same rows. ``arrival(board, number)``
    is the step that waits for every rank's row on the board
    (:class:`mpx.collectives.node.call_board.Arrival`, which the caller passes).
    """
    board: Board | None = comm.call_board
    if board is not None and current_policy().check == "auto":
        number = board.post(row)  # now: when the call's turn has come, in order
        if not board.arrived(number):
            yield arrival(board, number)
        if board.same(number):  # in C where fast_path is compiled
            return
    else:
        every = np.empty((comm.size, ROW), dtype=np.int64)
        yield Requests([comm.mpi.Iallgather(row, every)])
        if not calls_differ(every):
            return
    yield from mismatch_steps(comm.mpi, op, call())


def mismatch_steps(mpi: MPI.Intracomm, op: str, call: Call | Mapping[str, Hashable]) -> Steps[None]:
    """Steps after a mismatch that every rank has seen: exchange the calls, raise.

    One more small exchange, which every rank makes because every rank saw
    the same rows; then each raises the same :class:`MismatchError`.
    """
    data = pickle.dumps(call, protocol=pickle.HIGHEST_PROTOCOL)
    every = [pickle.loads(part) for part in (yield from gather_bytes(mpi, data))]
    if isinstance(call, Mapping):
        error = fields_differ(op, every) if all(isinstance(c, Mapping) for c in every) else None
    else:
        error = (
            first_difference(op, every, " (MPX_CHECK)")
            if all(isinstance(c, tuple) for c in every)
            else None
        )
    raise error or MismatchError(
        f"{op}: ranks made different calls (MPX_CHECK): "
        + "; ".join(f"rank {r}: {c!r}" for r, c in enumerate(every[:8]))
        + "; every rank must make the same collective calls in the same order"
    )
