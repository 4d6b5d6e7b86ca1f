"""A :class:`~mpx.collectives.Communicator`'s cross-rank checks of calls and configurations.

The communicator's face of :mod:`mpx.collectives.core.consistency` (``MPX_CHECK``):
the comparison of one collective call's signature (``check_steps``, run by the
operations as their first steps; ``check_signature`` as a call of its own),
and the checks an upper layer asks for (``check_same`` for a configuration,
``check_sequence`` for an ordered layout).

:class:`CallChecks` is a base class of :class:`~mpx.collectives.Communicator`,
which provides what it declares (``mpi``, ``size``, ``call_board``, ``run``,
``allgather_object``); it is not used on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.core.consistency import (
    CHECKED_OPS,
    CONFIGURATION,
    Call,
    call_of,
    compare_steps,
    config_hash,
    encode,
    mismatch_steps,
    sequences_differ,
    signature_of,
)
from mpx.collectives.core.policy import current as current_policy
from mpx.collectives.node import Arrival, CallBoard

if TYPE_CHECKING:
    from mpx.collectives.base import Handle, Steps

__all__ = ["CallChecks"]

T = TypeVar("T")


class CallChecks:
    """The communicator's ``MPX_CHECK`` comparisons (see the module docstring)."""

    mpi: MPI.Intracomm
    size: int
    call_board: CallBoard | None

    if TYPE_CHECKING:

        def run(
            self, op: str, impl: str, steps: Steps[T], async_op: bool, timeout: float | None
        ) -> T | Handle[T]: ...

        def allgather_object(self, obj: Any, timeout: float | None = None) -> list[Any]: ...

    def check_signature(
        self,
        op: str,
        tensor: torch.Tensor | None,
        reduce_op: str = "",
        root: int = -1,
        timeout: float | None = None,
    ) -> None:
        """Compares this call's op, dtype, element count, reduce op and root across ranks.

        What every collective does first (unless ``MPX_CHECK=0``), as a call of
        its own. Collective.

        Raises:
            MismatchError: on every rank, naming the field that differs and
                every rank's call.
        """
        steps = self._compare(
            op,
            encode(signature_of(op, tensor, reduce_op, root)),
            lambda: call_of(op, tensor, reduce_op, root),
        )
        self.run(op + " (MPX_CHECK)", "check", steps, False, timeout)

    def check_steps(
        self, op: str, tensor: torch.Tensor | None, reduce_op: str = "", root: int = -1
    ) -> Steps[None] | None:
        """The consistency check of one collective call, as ``MPX_CHECK`` says: steps, or None.

        ``auto`` (the default) and ``1`` compare every call (see
        :mod:`mpx.collectives.core.consistency`); ``0`` nothing. The comparison runs
        as the first steps of the call itself (the operations chain it before
        their own): it is ordered with the call, and an ``async_op=True`` call
        does not block in it. Every rank takes part in it whatever it called
        before.

        The steps raise :class:`MismatchError` on every rank, naming the op,
        the field that differs and every rank's call.
        """
        if current_policy().check == "0" or op not in CHECKED_OPS:
            return None
        return self._compare(
            op,
            encode(signature_of(op, tensor, reduce_op, root)),
            lambda: call_of(op, tensor, reduce_op, root),
        )

    def _compare(
        self, op: str, row: np.ndarray, call: Callable[[], Call | Mapping[str, Hashable]]
    ) -> Steps[None]:
        """Steps: every rank's row of this call, compared (:func:`consistency.compare_steps`)."""
        return compare_steps(self, op, row, call, Arrival)

    def mismatch_steps(self, op: str, call: Call | Mapping[str, Hashable]) -> Steps[None]:
        """Steps after a mismatch that every rank has seen: exchange the calls, raise.

        (:func:`mpx.collectives.core.consistency.mismatch_steps` on this communicator.)
        """
        return mismatch_steps(self.mpi, op, call)

    def check_same(
        self, what: str, fields: Mapping[str, Hashable], timeout: float | None = None
    ) -> None:
        """Raises on every rank if the ranks passed different ``fields``. Collective.

        For a configuration that must agree across ranks (a quantized
        allreduce's bits and bucket size, a model's parameter layout). A hash of
        the fields is compared like a collective call (on the call board, or
        one small allgather), at every call; the fields themselves travel only
        after a mismatch. Does nothing under ``MPX_CHECK=0``.

        Raises:
            MismatchError: ``"<what>: ranks disagree on bits: rank 0 passed 4, rank 1 8; ..."``.

        Example::

            comm.check_same("quantized allreduce", {"bits": 4, "bucket_size": 512})
        """
        if current_policy().check == "0":
            return
        row = encode((CONFIGURATION, "", 0, "", -1), config_hash(what, fields))
        self.run(
            what + " (MPX_CHECK)",
            "check",
            self._compare(what, row, lambda: dict(fields)),
            False,
            timeout,
        )

    def check_sequence(
        self, what: str, noun: str, items: Sequence[str], timeout: float | None = None
    ) -> None:
        """Raises on every rank if the ranks passed different ordered lists. Collective.

        For layouts that must agree across ranks, compared once by the caller
        (a model's parameters when a data-parallel optimizer is built): the
        error names the first position that differs, or both lengths. Does
        nothing under ``MPX_CHECK=0``.

        Example::

            comm.check_sequence("DistributedOptimizer", "parameter",
                                [f"{n!r} {p.dtype}{list(p.shape)}" for n, p in named])
        """
        if current_policy().check == "0":
            return
        error = sequences_differ(what, noun, self.allgather_object(list(items), timeout))
        if error is not None:
            raise error
