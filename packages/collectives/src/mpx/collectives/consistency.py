"""Cross-rank consistency of collective calls (``MPX_CHECK``), on by default.

MPI matches collectives by their order on a communicator, nothing else: ranks
that pass different dtypes, element counts, reduce ops or roots get garbage,
a truncation error on one rank while another hangs, or a hang. So every call
is checked, at a cost small enough to leave on::

    MPX_CHECK    per call                            collective work
    ---------    ---------------------------------   -----------------------------
    auto         count the call; fold its            a signature this communicator
    (default)    signature's hash into a digest;     has not checked yet: compare it
                 keep the hash in a ring of the      (one small allgather); every
                 last INTERVAL calls                 INTERVAL calls: compare digests,
                                                     and on a difference find the
                                                     first call that differed
    1            --                                  compare every call's signature
    0            --                                  nothing

The comparison runs as the first steps of the call itself, so it is ordered
with the call and an ``async_op=True`` call never blocks in it; whether a call
compares is decided when it is issued.

A signature is what MPI matches on: the op, the dtype, the element count, the
reduce op and the root (a shape with the same element count reduces the same
memory, so it is not compared). In a correct program every rank calls the same
signatures in the same order, so every rank decides alike when to compare:
a signature is new on all ranks at the same call, and the INTERVAL-th call
comes at the same call on all. A mismatch in the first call of a signature is
caught before any data moves; a mismatch between signatures each rank has
used before (rank 0 repeats a [1000] call while rank 1 repeats a [999] one)
is caught at the next comparison of digests, and the error names the first
call that differed -- its results, and those since, are wrong.

What this cannot see: a rank whose call is new to it while the others repeat
one they have seen waits in the comparison while they wait in the data; both
wait until ``timeout=`` / ``MPX_TIMEOUT``, whose error names the ranks behind.

The cost (``benchmarks/bench_overhead.py``): a few arithmetic operations per
call on the compiled fast path, and one comparison every INTERVAL calls.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from mpx.collectives.errors import MismatchError
from mpx.collectives.policy import OPS

__all__ = [
    "CHECKED_OPS",
    "LEDGER_FIELDS",
    "ROW",
    "CallLedger",
    "Signature",
    "decode",
    "describe",
    "encode",
    "fields_differ",
    "first_difference",
    "sequences_differ",
    "signature_hash",
    "signature_of",
]

MASK = (1 << 63) - 1
PRIME = 0x100000001B3  # FNV-1a's 64-bit prime: a digest that depends on the order of calls

# The collectives the ledger counts. Point-to-point calls (send, recv) differ
# between peers by design and are matched by tag, not by order.
CHECKED_OPS = frozenset(OPS) - {"send", "recv"}

# The ledger's array (int64): the fast path reads and writes it through a pointer.
#   [0] calls counted   [1] digest   [2] the call at which digests are compared next
#   [3] INTERVAL        [4 + i % INTERVAL] the hash of call i
LEDGER_FIELDS = 4

Signature = tuple[str, str, int, str, int]
"""(op, dtype, element count, reduce op, root): ``""`` and -1 where they do not apply."""

_hashes: dict[Signature, int] = {}


def signature_hash(signature: Signature) -> int:
    """A 63-bit hash of a signature, the same in every process (unlike ``hash()``)."""
    found = _hashes.get(signature)
    if found is None:
        digest = hashlib.blake2b(repr(signature).encode(), digest_size=8).digest()
        found = _hashes[signature] = int.from_bytes(digest, "little") & MASK
    return found


def signature_of(op: str, tensor: torch.Tensor | None, reduce_op: str, root: int) -> Signature:
    if tensor is None:
        return (op, "", 0, reduce_op, root)
    return (op, str(tensor.dtype).replace("torch.", ""), tensor.numel(), reduce_op, root)


def describe(signature: Signature) -> str:
    """``allreduce(float32[1000], op='sum')``: how errors show a call."""
    op, dtype, count, reduce_op, root = signature
    parts = [f"{dtype}[{count}]"] if dtype else []
    if reduce_op:
        parts.append(f"op={reduce_op!r}")
    if root >= 0:
        parts.append(f"root={root}")
    return f"{op}({', '.join(parts)})"


_FIELDS = ("op", "dtype", "element count", "reduce op", "root")


def first_difference(op: str, signatures: Sequence[Signature], how: str) -> MismatchError | None:
    """The error for ranks whose signatures differ (None if all agree).

    Names the first field that differs and the call of rank 0 and of the first
    rank that differs from it, e.g. ``allreduce: ranks disagree on dtype:
    rank 0 passed float32[1000], rank 1 float64[1000]``.
    """
    other = next((r for r, s in enumerate(signatures) if s != signatures[0]), None)
    if other is None:
        return None
    mine, theirs = signatures[0], signatures[other]
    field = next(name for name, a, b in zip(_FIELDS, mine, theirs, strict=True) if a != b)
    differing = [r for r, s in enumerate(signatures) if s != mine]
    also = f" (ranks differing from rank 0: {differing})" if len(differing) > 1 else ""
    if field == "op":
        calls = f"rank 0 called {describe(mine)}, rank {other} {describe(theirs)}"
    elif field == "reduce op":
        calls = f"rank 0 passed op={mine[3]!r}, rank {other} op={theirs[3]!r}"
    elif field == "root":
        calls = f"rank 0 passed root={mine[4]}, rank {other} root={theirs[4]}"
    else:
        calls = f"rank 0 passed {mine[1]}[{mine[2]}], rank {other} {theirs[1]}[{theirs[2]}]"
    return MismatchError(
        f"{op}: ranks disagree on {field}: {calls}{also}{how}; every rank must make the "
        "same collective calls in the same order, with the same dtype, element count, "
        "reduce op and root"
    )


class CallLedger:
    """One communicator's record of its collective calls (``MPX_CHECK=auto``).

    The communicator compares what the ledger says is due; the ledger itself
    never communicates.

    Attributes:
        state: the int64 array described by ``LEDGER_FIELDS`` (shared with
            the fast path, which counts its calls in it).
        verified: signatures every rank has compared equal on this communicator
            (the fast path takes only these).
        seen: signatures counted here (compared, or to be compared, once).
        signatures: hash -> signature, for the hashes this rank has counted.
    """

    def __init__(self, interval: int) -> None:
        self.state = np.zeros(LEDGER_FIELDS + interval, dtype=np.int64)
        self.state[2] = interval
        self.state[3] = interval
        self.verified: set[Signature] = set()
        self.seen: set[Signature] = set()
        self.signatures: dict[int, Signature] = {}

    @property
    def calls(self) -> int:
        return int(self.state[0])

    @property
    def interval(self) -> int:
        return int(self.state[3])

    def count(self, signature: Signature) -> tuple[bool, bool]:
        """Counts one call: (its signature is new here, the digests are due now)."""
        h = signature_hash(signature)
        self.signatures[h] = signature
        self.count_hash(h)
        state = self.state
        n = int(state[0])
        due = n >= int(state[2])
        if due:
            state[2] = n + self.interval
        # New means new at issue time: an asynchronous call may be issued
        # before the comparison of an earlier one with its signature has run,
        # and every rank must decide alike whatever ran when.
        new = signature not in self.seen
        self.seen.add(signature)
        return new, due

    def count_hash(self, h: int) -> None:
        """Counts one call of a known signature (the fast path, run as Python)."""
        state = self.state
        n = int(state[0]) + 1
        state[0] = n
        state[1] = ((int(state[1]) * PRIME) ^ h) & MASK
        state[LEDGER_FIELDS + n % self.interval] = h

    def recent(self, state: np.ndarray | None = None) -> list[tuple[int, Signature | None]]:
        """The last calls counted, oldest first: (call number, signature).

        ``state``: a copy of :attr:`state` taken earlier (the position of an
        asynchronous call when it was issued); the current one by default.
        """
        state = self.state if state is None else state
        n, interval = int(state[0]), int(state[3])
        out: list[tuple[int, Signature | None]] = []
        for i in range(max(1, n - interval + 1), n + 1):
            h = int(state[LEDGER_FIELDS + i % interval])
            out.append((i, self.signatures.get(h)))
        return out

    def first_divergence(
        self, op: str, every: Sequence[list[tuple[int, Signature | None]]]
    ) -> MismatchError:
        """The error for digests that differ, from every rank's :meth:`recent` calls."""
        for position in range(min(len(calls) for calls in every)):
            signatures = [calls[position][1] for calls in every]
            if any(s != signatures[0] for s in signatures):
                number = every[0][position][0]
                known = [s if s is not None else (op, "?", 0, "", -1) for s in signatures]
                how = (
                    f" (call {number} on this communicator, found {every[0][-1][0] - number} "
                    "calls later by MPX_CHECK=auto's comparison of digests: its results and "
                    "those since are wrong)"
                )
                error = first_difference(known[0][0], known, how)
                if error is not None:
                    return error
        return MismatchError(
            f"{op}: ranks made different collective calls more than {self.interval} calls "
            f"ago (the digests of the {self.calls} calls on this communicator differ); set "
            "MPX_CHECK=1 to compare every call and find the first"
        )


_NAMES: dict[int, str] = {}


def _code(name: str) -> int:
    """A name (op, dtype, reduce op) as a stable int64; :func:`decode` maps it back."""
    code = signature_hash((name, "", 0, "", -1))
    _NAMES.setdefault(code, name)
    return code


for _name in (
    *CHECKED_OPS,
    "",
    "sum",
    "avg",
    "max",
    "min",
    "prod",
    "band",
    "bor",
    "bxor",
    *(str(v).replace("torch.", "") for v in vars(torch).values() if isinstance(v, torch.dtype)),
):
    _code(_name)

ROW = 7  # encode()'s length


def encode(signature: Signature, calls: int, digest: int) -> np.ndarray:
    """One call and the ledger's position as int64s (what ranks allgather to compare)."""
    op, dtype, count, reduce_op, root = signature
    return np.array(
        [_code(op), _code(dtype), count, _code(reduce_op), root, calls, digest], dtype=np.int64
    )


def decode(row: np.ndarray) -> tuple[Signature, int, int]:
    """Inverse of :func:`encode`: (signature, calls, digest)."""
    op, dtype, count, reduce_op, root, calls, digest = (int(x) for x in row)
    names = [_NAMES.get(code, f"<unknown {code:#x}>") for code in (op, dtype, reduce_op)]
    return (names[0], names[1], count, names[2], root), calls, digest


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
