"""Small blocking CPU collectives straight to MPI: no generator, no handle.

A 4 KiB allreduce costs MPI a few µs (``MPI_Iallreduce`` + wait). The general
path -- checks, ``auto`` selection, a generator driven by the communicator --
adds about 4 µs of Python to that. A call that would end as that one MPI call
anyway takes this path instead::

    allreduce(t) / broadcast(t, root)
      blocking, no timeout=, not MPX_CHECK=1       no --> general path
      plain contiguous CPU tensor, MPI dtype,      no --> general path
        not requiring grad, not empty
      the policy chooses "mpi" for it              no --> general path
        (policy.choose: the same decision, cached)
      MPX_CHECK=auto: the communicator is one      no --> general path
        node (it has a call board)
      communicator: no deadline, nothing queued    no --> general path
      --> MPX_CHECK=auto: the call's row on the call board, wait for the
          peers' rows, compare (in C: mpx.collectives.node.call_board's protocol)
      --> MPI_Iallreduce / MPI_Ibcast on the tensor's memory, wait

Where the policy gives the call to ``shm``'s flag-based small allreduce
(``shm<small``: a sum or avg on one node, :mod:`mpx.collectives.node.shm_flags`)
the last step is that protocol in one C call without the GIL instead of MPI
(the general path runs it as steps: the two meet).

It makes the same non-blocking MPI call as ``impl="mpi"`` (MPI never matches a
blocking collective with a non-blocking one, so a rank on this path still
meets a rank that called with ``async_op=True``), in the same FIFO order.
Whatever it does not take, including every bad argument, goes to the general
path, which raises the errors.

Compiled. This module is written in Cython's pure-Python mode: the same
source runs as Python, and is compiled to an extension module when the
package is built where a C compiler is found (``MPX_COLLECTIVES_CYTHON``;
``fast_path.pxd`` beside it holds the C declarations). Compiled, it calls
``MPI_Iallreduce``/``MPI_Ibcast`` and ``MPI_Wait`` itself -- the functions of
the MPI library mpi4py loaded, found with ``dlsym`` -- instead of through
mpi4py's Python methods, when that library has the MPICH ABI (MPICH, Intel
MPI, MVAPICH; checked at import: ``DIRECT``). That and the Python it saves
take a 4 KiB allreduce's cost from about 1.4× mpi4py's own prepared call to
about 1.1× on two ranks (``benchmarks/bench_overhead.py``). ``COMPILED`` says
which form runs.

On a communicator that waits *yielding* (an oversubscribed host, see
:mod:`mpx.collectives.base.handle`) the wait polls with ``MPI_Test`` and sleeps
between polls instead of spinning in ``MPI_Wait``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from mpi4py import MPI
from torch.utils.dlpack import from_dlpack

from mpx.collectives.base import LOCK, SUPPORTED_DTYPES, Requests, drive, wait_yielding
from mpx.collectives.core.communicator import Communicator, as_communicator, world
from mpx.collectives.core.consistency import call_of, encode
from mpx.collectives.core.mpi_ops import MPI_OPS
from mpx.collectives.core.mpi_ops import mpi_op as op_for
from mpx.collectives.core.policy import choose, current
from mpx.collectives.node import CODES, SLOT, Arrival, FlagWindow, calls_differ, flags_take
from mpx.collectives.node import use_compiled_board as use_compiled
from mpx.collectives.node import use_compiled_flags as flags_compiled

try:
    import cython
except ImportError:  # Cython is not installed: this module runs as Python
    from mpx.collectives.core._no_cython import cython

__all__ = [
    "COMPILED",
    "DIRECT",
    "allreduce",
    "board_arrived",
    "board_post",
    "board_same",
    "board_wait",
    "broadcast",
    "flags_arrived",
    "flags_post",
    "flags_reduce",
    "flags_wait",
    "payload",
]

COMPILED: bool = cython.compiled
"""Whether this module runs compiled (an extension module) or as Python source."""

# Supported dtypes that MPI reduces natively, with their MPI datatypes
# (float16 and bfloat16 need the general path's float32 detour; the rest of
# torch's dtypes get the general path's error).
_MPI_TYPES: dict[torch.dtype, MPI.Datatype] = {
    dtype: kind
    for dtype, kind in (
        (torch.float32, MPI.FLOAT),
        (torch.float64, MPI.DOUBLE),
        (torch.int8, MPI.INT8_T),
        (torch.int32, MPI.INT32_T),
        (torch.int64, MPI.INT64_T),
        (torch.uint8, MPI.UINT8_T),
    )
    if dtype in SUPPORTED_DTYPES
}

# Looked up once (compiled, these are C variables: see fast_path.pxd).
_SLOT = SLOT
_TENSOR = torch.Tensor
_IN_PLACE = MPI.IN_PLACE
_acquire = LOCK.acquire
_release = LOCK.release

# Bytes of the tensors this path has reduced or broadcast (ops.bytes_communicated adds them).
_payload = 0

# The cache of this path, per communicator (``comm.choices.fast``, beside the
# policy's decisions, so a reloaded policy drops it with them):
#   address -> the _Call last made on that address (it names its tensor's
#        bytes, dtype, op, impl and root: a call that differs looks further)
#   (address, bytes, dtype, op, impl) -> allreduce: a _Call, or False
#   (address, bytes, dtype, impl, root) -> broadcast: the same
#   ("allreduce", dtype, bytes, op, impl), ("broadcast", dtype, bytes, impl)
#        -> whether the policy sends such a call this way
# False sends the call to the general path. A _Call holds the MPI message
# ``[buffer, datatype]`` over the tensor's memory: a buffer object only names
# the memory, so one made for a tensor that has since died serves a new
# tensor at the same address as well. Bounded. The common call finds its
# _Call by address, allocating nothing (a key tuple per call would also
# bring the garbage collector round every 700 calls).
_LIMIT = 4096

# MPICH's ABI (mpi.h of MPICH and its derivatives): handles are C ints with
# these values. The compiled module calls MPI itself only where mpi4py's
# handles show this ABI; it needs no mpi.h to be built.
_MPICH_ABI = {"COMM_WORLD": 0x44000000, "FLOAT": 0x4C00040A, "SUM": 0x58000003}


def _handle(obj: Any) -> int:
    """An MPI handle as the 32-bit pattern of MPICH's C int."""
    return int(obj.handle) & 0xFFFFFFFF


def _direct() -> bool:
    """Whether the compiled module calls MPI itself (MPICH ABI, functions found)."""
    if not cython.compiled:
        return False
    if any(_handle(getattr(MPI, name)) != value for name, value in _MPICH_ABI.items()):
        return False  # another ABI (Open MPI, the standard ABI): through mpi4py
    return bool(mpx_mpi_load(os.fsencode(str(MPI.__file__))))


DIRECT: bool = _direct()
"""Whether MPI is called directly (compiled, MPICH ABI), not through mpi4py."""


class _Call:
    """One cached call of this path: what it is, and how to start it.

    ``bcast``, ``nbytes``, ``dtype``, ``op``, ``impl``, ``root``: the call
    (``op`` is ``""`` and ``root`` -1 where they do not apply). ``start(*args)``
    starts the request through mpi4py; ``queue`` is the communicator's FIFO
    (nothing may jump it). Compiled: ``board`` points to this rank's count on
    the communicator's board, and ``direct`` calls MPI with ``address``,
    ``count``, ``datatype``, ``target`` (the op's handle, or the root) and
    ``comm`` (MPICH handles) instead of ``start``. ``yielding``: wait by
    polling and sleeping (the communicator's choice), not in ``MPI_Wait``.
    """

    def __init__(
        self,
        comm: Communicator,
        key: tuple[Any, ...],
        bcast: bool,
        message: list[Any],
        count: int,
        mpi_op: Any,
        flags: bool,
    ) -> None:
        self.bcast = bcast
        # shm's flag-based allreduce (shm_flags) instead of MPI: the policy chose shm
        self.flags = flags
        self.code = CODES.get(key[2], -1)
        self.rank, self.size = comm.rank, comm.size
        self.nbytes, self.dtype = key[1], key[2]
        self.start: Any
        self.args: tuple[Any, ...]
        if bcast:
            self.op, self.impl, self.root = "", key[3], key[4]
            self.start, self.args = comm.mpi.Ibcast, (message, self.root)
        else:
            self.op, self.impl, self.root = key[3], key[4], -1
            self.start, self.args = comm.mpi.Iallreduce, (_IN_PLACE, message, mpi_op)
        self.queue = comm._queue._handles
        # MPI's count is a C int; an op made in Python (floating max/min,
        # impl_mpi.mpi_op) is called back by mpi4py, so it goes through mpi4py.
        self.direct = DIRECT and count < 2**31 and (bcast or mpi_op.is_predefined)
        self.yielding = bool(comm.yielding)
        self.address = key[0]
        self.count = count
        self.datatype = _handle(message[1]) if DIRECT else 0
        self.target = self.root if bcast else (_handle(mpi_op) if DIRECT else 0)
        self.comm = _handle(comm.mpi) if DIRECT else 0
        # MPX_CHECK=auto: the call is compared on the communicator's call board
        # (mpx.collectives.node.call_board) -- compiled, by C on its memory.
        self.checked = current().check == "auto"
        self.board_obj = comm.call_board
        signature = (
            "broadcast" if bcast else "allreduce",
            str(self.dtype).replace("torch.", ""),
            count,
            self.op,
            self.root,
        )
        self.row_obj = encode(signature)
        self.r_op, self.r_dtype, self.r_count, self.r_reduce, self.r_root = (
            int(x) for x in self.row_obj[:5]
        )
        self.node_rank = comm.node_rank
        self.node_size = comm.node_size
        if cython.compiled:
            slot = comm._board.ctypes.data + comm._board.itemsize * comm.node_rank
            self.board = cython.cast(cython.p_longlong, cython.cast(cython.size_t, slot))
            if self.checked:
                board = comm.call_board
                assert board is not None  # _takes: checked calls need one
                self.slots = cython.cast(
                    cython.p_longlong, cython.cast(cython.size_t, board.address)
                )
                counter = board.counter.ctypes.data
                self.counter = cython.cast(cython.p_longlong, cython.cast(cython.size_t, counter))


def payload() -> int:
    """Bytes of the tensors handed to this path so far (see ``ops.bytes_communicated``)."""
    return _payload


def _takes(op: str, reduce_op: str, t: torch.Tensor, comm: Communicator, impl: str | None) -> str:
    """How this path runs the call: ``"mpi"`` (one MPI call), ``"flags"`` (shm's
    flag-based allreduce, :mod:`mpx.collectives.node.shm_flags`) or ``""`` (it does not)."""
    kind = _MPI_TYPES.get(t.dtype)
    if not (
        kind is not None
        and t.nbytes > 0
        and (op != "allreduce" or reduce_op in MPI_OPS)
        and not (reduce_op == "avg" and not t.is_floating_point())
        and current().check != "1"
        and (current().check == "0" or comm.call_board is not None)
    ):
        return ""
    chosen = choose(op, False, t.nbytes, comm, impl, t.dtype, reduce_op)
    if chosen == "mpi":
        return "mpi"
    limit = current().flag_bytes
    flags = flags_take(comm.size, comm.single_node, t.dtype, reduce_op, t.nbytes, limit)
    return "flags" if chosen == "shm" and op == "allreduce" and COMPILED and flags else ""


def _lookup(
    comm: Communicator, t: torch.Tensor, bcast: bool, op: str, impl: str | None, root: int
) -> Any:
    """The _Call of this call on ``comm``, or None (the general path's)."""
    nbytes = t.nbytes
    dtype = t.dtype
    address = t.data_ptr()
    cache = comm.choices
    if cache.policy is current():
        call = cache.fast.get(address)
        if (
            call is not None
            and call.bcast == bcast
            and call.nbytes == nbytes
            and call.dtype is dtype
            and call.op == op
            and call.impl == impl
            and call.root == root
        ):
            return call
    else:
        cache.reset(current())
    if bcast:
        key: tuple[Any, ...] = (address, nbytes, dtype, impl, root)
        plan_key: tuple[Any, ...] = ("broadcast", dtype, nbytes, impl)
    else:
        key = (address, nbytes, dtype, op, impl)
        plan_key = ("allreduce", dtype, nbytes, op, impl)
    entry = cache.fast.get(key)
    if entry is None:
        taken = cache.fast.get(plan_key)
        if taken is None:
            taken = _takes("broadcast" if bcast else "allreduce", op, t, comm, impl)
            cache = comm.choices  # choose() renews it for a new policy
        entry = False
        if taken:
            message = [MPI.buffer.fromaddress(address, nbytes), _MPI_TYPES[dtype]]
            entry = _Call(
                comm,
                key,
                bcast,
                message,
                t.numel(),
                None if bcast else op_for(op, dtype),
                taken == "flags",
            )
        if len(cache.fast) >= _LIMIT:
            cache.fast.clear()
        cache.fast[plan_key] = taken
        cache.fast[key] = entry
    if entry is False:
        return None
    cache.fast[address] = entry
    return entry


def _run_now(comm: Communicator, call: _Call, t: torch.Tensor) -> bool:
    """Compares the call across ranks, starts its MPI request and waits for it.

    Returns False, having done nothing, when the communicator has a deadline
    (``MPX_TIMEOUT``), is broken, or has collectives queued: the caller then
    takes the general path, which orders, times out and reports. Otherwise
    this is ``Communicator.run`` for the check's steps and one request: the
    call is posted on the call board and counted on the node's board under
    the lock (the progress thread's turn comes before or after it); the wait
    for the peers' rows, and for the request, happen outside it (see ``run``).

    Raises:
        MismatchError: on every rank, when the ranks' calls differ (nothing
            of the data has moved).
    """
    if comm.timeout is not None or comm._broken is not None or comm._freed:
        return False
    window: Any = None
    bases = cython.NULL if cython.compiled else None
    buffer = number = 0
    if call.flags:
        # Made by the general path's first such call (collective); a call
        # before that, or after a policy raised MPX_SHM_FLAG_BYTES, goes there.
        window = comm._cache.get("shm_flags")
        if type(window) is not FlagWindow or window.buffer < call.nbytes or not window.address:
            return False
        bases = cython.cast(cython.p_longlong, cython.cast(cython.size_t, window.address))
        buffer = window.buffer
    err = 0
    request = 0
    n = 0
    same = 1
    _acquire()
    try:
        if call.queue:
            return False
        if call.checked:
            if cython.compiled:
                n = call.counter[0] + 1
                call.counter[0] = n
                mpx_board_post(
                    call.slots,
                    call.node_rank,
                    n,
                    call.r_op,
                    call.r_dtype,
                    call.r_count,
                    call.r_reduce,
                    call.r_root,
                    0,  # the configuration hash: none for a collective call
                )
            else:
                assert call.board_obj is not None  # _takes: checked calls need one
                n = call.board_obj.post(call.row_obj)
        if cython.compiled:
            call.board[0] += 1  # Communicator._announce
        else:
            comm._announce()
    finally:
        _release()
    if call.checked:
        if cython.compiled:
            with cython.nogil:
                same = mpx_board_meet(call.slots, call.node_size, call.node_rank, n, call.yielding)
        else:
            assert call.board_obj is not None
            arrival = Arrival(call.board_obj, n)
            if call.yielding:
                wait_yielding(arrival)
            else:
                arrival.wait()
            same = not calls_differ(call.board_obj.rows(n))
        if not same:
            op = "broadcast" if call.bcast else "allreduce"
            drive(comm.mismatch_steps(op, call_of(op, t, call.op, call.root)), call.yielding)
    _acquire()
    try:
        if cython.compiled and call.flags:
            with cython.nogil:
                number = mpx_flags_first(bases, call.rank, buffer, call.address, call.nbytes)
        elif cython.compiled and call.direct:
            with cython.nogil:
                err = mpx_mpi_start(
                    call.bcast,
                    call.address,
                    call.count,
                    call.datatype,
                    call.target,
                    call.comm,
                    cython.address(request),
                )
        else:
            mpi_request = call.start(*call.args)
    finally:
        _release()
    if cython.compiled and call.flags:
        with cython.nogil:
            mpx_flags_rest(
                bases,
                call.rank,
                call.size,
                buffer,
                number,
                call.address,
                call.nbytes,
                call.count,
                call.code,
                call.yielding,
            )
    elif cython.compiled and call.direct:
        if err == 0:
            if call.yielding:
                with cython.nogil:
                    err = mpx_mpi_wait_yielding(cython.address(request))
            else:
                with cython.nogil:
                    err = mpx_mpi_wait(cython.address(request))
        if err != 0:
            raise MPI.Exception(err)
    elif call.yielding:
        wait_yielding(Requests([mpi_request]))
    else:
        mpi_request.Wait()
    return True


def allreduce(t: Any, op: str, comm: Any, impl: str | None) -> bool:
    """Runs a small blocking allreduce; False (nothing done) if it is not one."""
    global _payload  # noqa: PLW0603 -- compiled, a C counter (fast_path.pxd)
    if type(t) is not _TENSOR or not t.is_cpu or t.requires_grad or not t.is_contiguous():
        return False
    if comm is None:
        comm = world()
    elif type(comm) is not Communicator:
        comm = as_communicator(comm)  # an mpi4py communicator (or the error for anything else)
    call = _lookup(comm, t, False, op, impl, -1)
    if call is None or not _run_now(comm, call, t):
        return False
    if op == "avg":
        # MPI wrote through the pointer; torch's division refuses an inference tensor
        # outside inference_mode: divide through a normal alias of its memory.
        (from_dlpack(t) if t.is_inference() else t).div_(comm.size)
    _payload += call.nbytes
    return True


def broadcast(t: Any, root: int, comm: Any, impl: str | None) -> bool:
    """Runs a small blocking broadcast; False (nothing done) if it is not one."""
    global _payload  # noqa: PLW0603 -- compiled, a C counter (fast_path.pxd)
    if type(t) is not _TENSOR or not t.is_cpu or t.requires_grad or not t.is_contiguous():
        return False
    if type(root) is not int:
        return False
    if comm is None:
        comm = world()
    elif type(comm) is not Communicator:
        comm = as_communicator(comm)  # an mpi4py communicator (or the error for anything else)
    if not 0 <= root < comm.size:
        return False
    call = _lookup(comm, t, True, "", impl, root)
    if call is None or not _run_now(comm, call, t):
        return False
    _payload += call.nbytes
    return True


# The call board's protocol for the general path (call_board.CallBoard), in C:
# the same functions as the fast path's, on the board's addresses as ints.


def board_post(slots: int, counter: int, me: int, row: Any) -> int:
    """``CallBoard.post``: counts the call at ``counter``, posts ``row`` as its row."""
    counted = cython.cast(cython.p_longlong, counter)
    n = counted[0] + 1
    counted[0] = n
    mpx_board_post(
        cython.cast(cython.p_longlong, slots), me, n, row[0], row[1], row[2], row[3], row[4], row[5]
    )
    return int(n)


def board_arrived(slots: int, size: int, number: int) -> bool:
    """``CallBoard.arrived``: whether every rank has posted call ``number``."""
    return bool(mpx_board_arrived(cython.cast(cython.p_longlong, slots), size, number))


def board_same(slots: int, size: int, me: int, number: int) -> bool:
    """``CallBoard.same``: whether every rank's row of call ``number`` equals this rank's."""
    return bool(mpx_board_same(cython.cast(cython.p_longlong, slots), size, me, number))


def board_wait(slots: int, size: int, number: int, yielding: bool) -> None:
    """``CallBoard.wait``: waits (without the GIL) until every rank has posted ``number``."""
    board = cython.cast(cython.p_longlong, slots)
    with cython.nogil:
        mpx_board_wait(board, size, number, yielding)


# shm's flag-based allreduce for the general path (shm_flags), addresses as ints.


def flags_post(bases: int, me: int, buffer: int, src: int, nbytes: int) -> int:
    """Copies ``nbytes`` at ``src`` into this rank's next buffer and posts it all; the
    flag value every rank reaches when it has posted the whole call."""
    table = cython.cast(cython.p_longlong, bases)
    with cython.nogil:
        number = mpx_flags_post(table, me, buffer, src, nbytes)
    return int(number)


def flags_arrived(bases: int, size: int, number: int) -> bool:
    """Whether every rank's flag reads ``number`` (flags_post's value; one look)."""
    return bool(mpx_flags_arrived(cython.cast(cython.p_longlong, bases), size, number))


def flags_wait(bases: int, size: int, number: int, yielding: bool) -> None:
    """Waits (without the GIL) until every rank's flag reads ``number`` (flags_post's)."""
    table = cython.cast(cython.p_longlong, bases)
    with cython.nogil:
        mpx_flags_wait(table, size, number, yielding)


def flags_reduce(
    bases: int, size: int, buffer: int, number: int, dst: int, count: int, code: int
) -> None:
    """Sums the buffers of every rank of the call that flags_post numbered ``number``
    into the ``count`` elements at ``dst``."""
    table = cython.cast(cython.p_longlong, bases)
    with cython.nogil:
        mpx_flags_reduce(table, size, buffer, number, dst, count, code)


if cython.compiled:
    # Every CallBoard made from now on runs the protocol in C (the package's
    # __init__ imports this module before any communicator can be made).
    use_compiled(board_post, board_arrived, board_same, board_wait)
    flags_compiled(flags_post, flags_arrived, flags_wait, flags_reduce)  # and shm_flags' kernel


if not cython.compiled:
    # Compiled, these are C functions of fast_path.pxd; as Python, never called.

    def _compiled_only(*_: Any) -> Any:
        raise AssertionError("compiled only")

    mpx_mpi_load = mpx_mpi_start = mpx_mpi_wait = mpx_mpi_wait_yielding = _compiled_only
    mpx_board_post = mpx_board_arrived = mpx_board_same = _compiled_only
    mpx_board_wait = mpx_board_meet = _compiled_only
    mpx_flags_post = mpx_flags_arrived = mpx_flags_wait = mpx_flags_reduce = _compiled_only
    mpx_flags_first = mpx_flags_rest = _compiled_only
