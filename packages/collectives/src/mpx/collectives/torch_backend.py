"""mpx as a ``torch.distributed`` backend: ``dist.init_process_group("mpx")``.

A Python subclass of ``dist.ProcessGroup`` forwards torch's collectives to
mpx's (so ``impl="auto"`` chooses shm/ring/mpi for them) and wraps each
:class:`Handle` in a ``dist.Work``::

    DistributedDataParallel ── dist.all_reduce(bucket) ── MPXProcessGroup.allreduce
                                                              └─ mpx allreduce(async_op=True)
                                                                   └─ MPXWork(handle).get_future()
                                                                        completed by mpx's
                                                                        progress thread

The work is asynchronous as gloo's: the progress thread advances the handle
and completes the work's future, so DDP's bucket allreduces overlap backward.

Every c10d operation is here: the reductions (all_reduce, reduce,
reduce_scatter and their tensor/coalesced forms), the data movers (broadcast,
all_gather, gather, scatter, all_to_all, uneven splits included) and
point-to-point (send/recv/isend/irecv, from any source, batch_isend_irecv).
Dtypes and ReduceOps mpx has no kernel for travel in the forms of
:mod:`mpx.collectives.torch_forms`; what still cannot work raises an mpx
error naming the op.

The ranks come from MPI, not from a rendezvous: :func:`init_process_group`
needs no MASTER_ADDR and works under any MPI launcher. Every group
(``dist.new_group([0, 1])`` in a 3-rank job too) gets an MPI communicator of
its own, made by its members alone (``MPI_Comm_create_group``) and freed by
``destroy_process_group``. The
``timeout`` given to ``init_process_group``/``new_group`` bounds every
operation of the group (:class:`CollectiveTimeout` after it, as gloo
raises). This module is the one place that relies on torch's ProcessGroup
extension points (subclassing ``dist.ProcessGroup`` and ``dist.Work`` in
Python).
"""

from __future__ import annotations

import contextlib
import gc
import secrets
import sys
import threading
import time
import types
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives import ops, progress
from mpx.collectives._torch_private import on_builtin_comm_hook
from mpx.collectives.communicator import Communicator, world
from mpx.collectives.dtypes import numpy_view
from mpx.collectives.errors import CollectiveTimeout, MPXTypeError, MPXValueError
from mpx.collectives.handle import LOCK, Handle
from mpx.collectives.torch_forms import (
    BITWISE,
    ReduceForm,
    bytes_of,
    reduce_form,
    reduce_op,
    versions_as_gloo,
)
from mpx.collectives.torch_futures import COMPLETING, MPXFuture, tensor_list_future

__all__ = [
    "BACKEND_NAME",
    "MPXProcessGroup",
    "MPXWork",
    "init_process_group",
    "register_torch_backend",
]

BACKEND_NAME = "mpx"
_Class = TypeVar("_Class")


def _called_from_cpp() -> bool:
    """True when the caller of ``get_future`` is torch's C++ (a Work's ``getFuture()``).

    C++ calls the Python override from no Python frame that names it: the
    innermost Python frame is whatever called into C++ (``backward()``), or
    none at all. Python code that calls ``work.get_future()`` names it.
    """
    try:
        caller: types.FrameType | None = sys._getframe(2)  # 0: this, 1: get_future, 2: caller
    except ValueError:  # no Python frame: a C++ thread
        return True
    while caller is not None and caller.f_code.co_filename in _EAGER_WRAPPER_FILE:
        caller = caller.f_back  # torch.compiler.disable's wrapper (_run_eagerly)
    return caller is None or "get_future" not in caller.f_code.co_names


def _run_eagerly(cls: type[_Class]) -> type[_Class]:
    """Marks ``cls``: the methods torch calls are wrapped in ``torch.compiler.disable``.

    torch's C++ calls these Python overrides from inside compiled code
    (``torch.compile(DDP(m))``: the reducer's bucket rebuild broadcasts), and
    dynamo then tries to compile their frames, with ``self`` as an opaque
    process group whose Python members it does not know (``Member
    '_check_root' is not registered``). Run eagerly, as gloo's C++ methods
    are. Only torch's entry points are wrapped: each wrapper costs ~1.5 us.
    The wrapping waits for the first group (:func:`_make_eager`):
    ``torch.compiler.disable`` imports ``torch._dynamo``, 1.4 s of every
    rank's start-up when done at import, in jobs that never make a group.
    """
    _EAGER_CLASSES.append(cls)
    return cls


def _make_eager() -> None:
    """Wraps the marked classes' torch entry points, once (the first group does it)."""
    with _EAGER_LOCK:
        if _EAGER_WRAPPER_FILE:
            return
        disable: Any = torch.compiler.disable  # untyped in torch
        for cls in _EAGER_CLASSES:
            base = next(b for b in cls.__mro__[1:] if b.__module__.startswith("torch"))
            for name, value in list(vars(cls).items()):
                entry = hasattr(base, name) or name == "getBackendName"
                if entry and isinstance(value, types.FunctionType) and not name.startswith("__"):
                    setattr(cls, name, disable(value, reason="mpx runs eagerly"))
        _EAGER_WRAPPER_FILE.append(disable(_make_eager).__code__.co_filename)


_EAGER_CLASSES: list[type[Any]] = []
_EAGER_LOCK = threading.Lock()
# The file of torch.compiler.disable's wrapper, once _make_eager has run.
_EAGER_WRAPPER_FILE: list[str] = []


@_run_eagerly
class MPXWork(dist.Work):
    """A ``dist.Work`` over mpx handles; ``then`` runs when they complete.

    Asynchronous as gloo's: the handles advance on mpx's progress thread,
    which also finishes the work (``then``, then the future) once they are
    done, so a future from :meth:`get_future` completes while the caller
    computes -- DDP chains its bucket hooks on it and overlaps the buckets'
    allreduce with the rest of the backward pass::

        backward: bucket 1 ready -> allreduce(async) -> future 1   (returns at once)
        backward continues            progress thread: ... bucket 1 done,
        backward: bucket 2 ready ...      write back, future 1 completed, hooks run
        finalize: future 1, 2 ... wait    (mostly done already)

    ``wait()``, ``is_completed()`` and ``result()`` finish it too (whichever
    comes first; a lock makes it happen once), and so does a wait on its
    future from any thread (:class:`~mpx.collectives.torch_futures.MPXFuture`):
    a callback that starts a collective and waits for it -- torch's PowerSGD
    hook -- drives it itself instead of waiting for the progress thread that
    may be running that very callback. An operation still unfinished
    at the group's timeout fails the work: ``wait()`` and the future raise
    :class:`CollectiveTimeout`. Without a progress thread
    (``MPX_PROGRESS_THREAD=0``, or MPI without ``MPI_THREAD_MULTIPLE``)
    :meth:`get_future` finishes the work before it returns.
    """

    def __init__(
        self,
        handles: Sequence[Handle[Any]],
        result: list[torch.Tensor],
        then: Callable[[], None] | None = None,
        source: Callable[[], int] | None = None,
        timeout: float | None = None,
        lists_for_cpp: bool = True,
        driven: bool = False,
        value: list[list[torch.Tensor]] | None = None,
    ) -> None:
        super().__init__()
        # The Python future's value where it is not ``result``: c10d's allgather of
        # several inputs gives one list per input, as gloo's future does.
        self._value = value
        self._lists_for_cpp = lists_for_cpp
        self._handles = list(handles)
        # The handles the progress thread advances itself (mpx handles of a
        # communicator with background_progress, as the group's are): it has
        # polled them just before it asks ready(), which then reads their state
        # instead of polling each a second time on every turn of the thread.
        self._driven = driven
        self._result = result
        self._then = then
        self._source = source
        self._timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._lock = threading.RLock()  # the caller and the progress thread may both finish
        self._finished = False
        self._error: BaseException | None = None
        self._future: MPXFuture[list[torch.Tensor]] | None = None  # for Python callers
        self._c10_future: torch.futures.Future[list[torch.Tensor]] | None = None  # for torch's C++
        self._watched = False  # handed to the progress thread
        # What completes the futures handed out and not yet completed; run by the
        # thread that finishes the work, outside the lock.
        self._unsettled: list[Callable[[], None]] = []

    def _finish(self, expired: bool = False) -> None:
        """Waits for the handles, runs ``then``, completes the futures; raises the work's error.

        Any thread may call it: the caller's ``wait()``, the progress thread,
        a wait on the work's future (:class:`MPXFuture`). The futures are
        completed outside the lock: their callbacks may wait on other works,
        and a thread waiting on this one must not hold them up meanwhile.
        """
        with self._lock:
            if not self._finished:
                try:
                    for handle in self._handles:
                        self._wait_for(handle, expired)
                    if self._then is not None:
                        self._then()
                except BaseException as error:
                    self._error = error
                self._finished = True
            settle, self._unsettled = self._unsettled, []
        with COMPLETING:  # a then() in a callback finishes its operation first
            for complete in settle:
                complete()
        if self._error is not None:
            raise self._error

    def _wait_for(self, handle: Handle[Any], expired: bool) -> None:
        try:
            # Past the group's deadline: one look, no wait (Handle.wait takes a
            # timeout > 0 only; a microsecond is as good as none).
            handle.wait(1e-6 if expired else None)
        except CollectiveTimeout as late:
            raise CollectiveTimeout(
                late.op,
                late.impl,
                self._timeout if self._timeout is not None else late.seconds,
                late.peers,
                "the process group's timeout (init_process_group/new_group "
                "timeout=) expired; every later operation of this group raises",
            ) from late

    def _complete_future(self) -> None:
        assert self._future is not None
        if self._error is None:
            value: Any = self._result if self._value is None else self._value
            self._future.set_result(value)
        else:
            self._future.set_exception(_as_exception(self._error))  # type: ignore[arg-type]  # (stub: the value type)

    # -- the progress thread's side (mpx.collectives.progress.Completion) ---------

    def _handles_done(self) -> bool:
        """Whether every handle is complete; polls only those the progress thread does not."""
        driven = self._driven
        for handle in self._handles:
            if driven and type(handle) is Handle:
                if not handle.completed:
                    return False
            elif not handle.done():
                return False
        return True

    def ready(self) -> bool:
        """Every handle done, or the group's timeout past (polled under mpx's LOCK)."""
        try:
            if self._handles_done():
                return True
        except BaseException:  # complete() meets it again and hands it to the future
            return True
        return self._deadline is not None and time.monotonic() > self._deadline

    def complete(self) -> None:
        """Finishes the work on the progress thread; an error goes to the future."""
        try:
            expired = not self._handles_done()
        except BaseException:  # _finish meets it again and hands it to the future
            expired = False
        # try, not contextlib.suppress: three Python calls fewer per work on this thread.
        try:  # noqa: SIM105
            self._finish(expired)
        except BaseException:  # the futures carry it; the progress thread lives on
            pass

    # -- torch's Work ---------------------------------------------------------------

    def is_completed(self) -> bool:
        """Non-blocking; True once the operation is done and its outputs written."""
        if not self._finished and all(handle.done() for handle in self._handles):
            with contextlib.suppress(BaseException):  # wait() and the future raise it
                self._finish()
        return self._finished

    def is_success(self) -> bool:
        self.wait()
        return True

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._finish()
        return True

    def result(self) -> list[torch.Tensor]:
        self._finish()
        return self._result

    def _source_rank(self) -> int:
        self._finish()
        if self._source is None:
            raise MPXValueError(
                "_source_rank: only a recv from any source knows its source; this work is not one"
            )
        return self._source()

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        """A future completed (with the outputs, or the work's error) when the work finishes.

        To Python, an :class:`MPXFuture`: its ``wait()`` (and that of the
        futures chained on it) finishes the work in the waiting thread, so a
        callback may wait on another work at any depth. To torch's C++ (DDP's
        built-in hooks), a future whose value is a c10 tensor list
        (:func:`tensor_list_future`), which C++ reads as it reads gloo's --
        where the group has a C++ reader of lists (``lists_for_cpp``, see
        :meth:`MPXProcessGroup.cpp_reads_lists`); DDP's own reduction reads
        the Python future too, and it costs no inter-op hop.
        """
        if self._lists_for_cpp and _called_from_cpp():
            return self._tensor_list_future()
        with self._lock:
            if self._future is None:
                self._future = MPXFuture(self._finish)
                self._unsettled.append(self._complete_future)
            future = self._future
        self._complete_when_done()
        return future

    def _tensor_list_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        with self._lock:
            if self._c10_future is None:
                self._c10_future, complete = tensor_list_future(self._result)
                self._unsettled.append(lambda: complete(self._error))
            future = self._c10_future
        self._complete_when_done()
        return future

    def _complete_when_done(self) -> None:
        """Completes the futures when the work finishes: now, on the progress thread, or soon."""
        with self._lock:
            finished, watched, self._watched = self._finished, self._watched, True
        # A finished work completes them now; an unfinished one, on the progress
        # thread or when waited for; without a progress thread, nobody would
        # later: finish it now.
        if finished or (not watched and not progress.when_ready(self)):
            with contextlib.suppress(BaseException):  # the futures carry it
                self._finish()


def _as_exception(error: BaseException) -> Exception:
    """torch's futures carry an Exception; a BaseException (KeyboardInterrupt) travels wrapped."""
    return error if isinstance(error, Exception) else RuntimeError(repr(error))


class _MPIRequest:
    """A receive from any source, posted on mpx's private communicator.

    mpx's ``recv`` names its source; torch's ``recv(src=None)`` does not, so
    this one request is posted here, beside mpx's sends (which travel on the
    same communicator, ``comm.mpi``, with the caller's tag).
    """

    def __init__(self, request: MPI.Request, timeout: float | None) -> None:
        self._request = request
        self._timeout = timeout
        self._status = MPI.Status()
        self._done = False

    def wait(self, timeout: float | None = None) -> None:
        limit = self._timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        # Polled, not MPI_Wait: the progress thread may test the same request,
        # and MPI forbids completing one request from two threads at once.
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                assert limit is not None
                raise CollectiveTimeout("recv", "mpi", limit, [])
            time.sleep(1e-4)

    def done(self) -> bool:
        if not self._done:
            with LOCK:
                self._done = self._done or bool(self._request.Test(self._status))
        return self._done

    def source(self) -> int:
        self.wait()
        return int(self._status.Get_source())


def _dense(t: torch.Tensor) -> bool:
    """Contiguous in some memory format (channels-last counts, as in c10d's checks)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return t.is_contiguous() or (
        t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()])
    )


def _all_of(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """torch's list form of an argument also given as one tensor (``pg.allreduce(t)``)."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _rows(stacked: torch.Tensor, size: int) -> torch.Tensor:
    return stacked.reshape(size, -1)


@_run_eagerly
class MPXProcessGroup(dist.ProcessGroup):
    """The ``"mpx"`` process group: torch collectives on an mpx :class:`Communicator`.

    Example::

        init_process_group()                       # or dist.init_process_group("mpx")
        model = DistributedDataParallel(model)     # gradients averaged by mpx
        dist.all_reduce(t)
    """

    def __init__(self, comm: Communicator, timeout: timedelta | None = None) -> None:
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self.comm = comm
        # Every operation of the group is bounded by the group's timeout.
        self.timeout_s = None if timeout is None else timeout.total_seconds()
        self._group_name = ""
        self._shut = False
        self._group_desc = ""
        # Whether torch's C++ reads this group's futures as c10 tensor lists
        # (a built-in comm hook registered on a DDP over it): see cpp_reads_lists.
        self._cpp_reads_lists = False
        _make_eager()
        _note_builtin_hooks()  # "mpx" may come from torch's entry point, not register_torch_backend

    def cpp_reads_lists(self) -> None:
        """From now on torch's C++ gets this group's futures as c10 tensor lists.

        torch's built-in comm hooks (``BuiltinCommHookType.FP16_COMPRESS``)
        read a future's value in C++ as a tensor list; DDP's default reduction
        (no hook, or a Python hook) reads a Python value as well. A tensor-list
        future costs a TorchScript task per operation: its call releases the
        GIL, which the progress thread then holds for up to a switch interval
        (~2 ms per bucket measured on the loaded 2-core machine, two inter-op
        threads more), so only groups that need it pay: a DDP registering a
        built-in hook calls this (:func:`_note_builtin_hooks`, through
        :func:`mpx.collectives._torch_private.on_builtin_comm_hook`). Call it
        yourself before handing the group to other C++ code that reads
        ``getFuture()->value().toTensorList()``.
        """
        self._cpp_reads_lists = True

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend(self, device: Any) -> Any:
        """The backend of ``device``: this group itself, which torch registered none for.

        torch 2.14's ``batch_isend_irecv`` asks every ProcessGroup (2.13: only an
        exact ProcessGroup) for its backend, to see whether it coalesces; a
        Python group has none registered and torch raised "No backend type
        associated with device type cpu". This one does not coalesce.
        """
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name on its C++ backends, which a Python group
    # has none of: ``destroy_process_group(group)`` reads it back from here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def shutdown(self) -> None:
        """Frees the group's MPI communicator (``destroy_process_group`` calls it)."""
        if not self._shut:
            self._shut = True
            self.comm.free()

    # -- helpers ------------------------------------------------------------------

    def _work(
        self,
        handles: Sequence[Handle[Any]],
        result: list[torch.Tensor],
        then: Callable[[], None] | None = None,
        source: Callable[[], int] | None = None,
        versions: Callable[[], None] | None = None,
        value: list[list[torch.Tensor]] | None = None,
    ) -> MPXWork:
        """A work of this group: it fails at the group's timeout.

        ``versions`` (:func:`versions_as_gloo`, made as the operation started)
        runs after ``then``; ``value`` is the future's value where it is not
        ``result``.
        """
        if versions is not None:
            then = versions if then is None else _in_turn([then, versions])
        return MPXWork(
            handles,
            result,
            then,
            source,
            self.timeout_s,
            lists_for_cpp=self._cpp_reads_lists,
            driven=self.comm.background_progress,
            value=value,
        )

    def _joined(self, works: Sequence[MPXWork], result: list[torch.Tensor]) -> MPXWork:
        """One work over several (the coalesced forms): done when all of them are."""
        handles = [handle for work in works for handle in work._handles]
        return self._work(handles, result, _in_turn([work.wait for work in works]))

    def _allreduce_form(self, form: ReduceForm) -> Handle[torch.Tensor]:
        """An in-place allreduce of ``form.tensor``; BAND/BOR/BXOR by gather and fold."""
        if form.op not in BITWISE:
            return ops.allreduce(
                form.tensor, form.op, comm=self.comm, async_op=True, timeout=self.timeout_s
            )
        fold = BITWISE[form.op]
        gathered = self._allgather_bytes(form.tensor)  # any integer dtype, bool too

        def folded() -> torch.Tensor:
            rows = gathered.wait().view(form.tensor.dtype).reshape(self.comm.size, -1)
            out = rows[0].clone()
            for row in rows[1:]:
                out = fold(out, row)
            form.tensor.copy_(out.reshape(form.tensor.shape))
            return form.tensor

        return _Deferred(gathered, folded)  # type: ignore[return-value]

    def _allgather_bytes(self, t: torch.Tensor) -> Handle[torch.Tensor]:
        data, _ = bytes_of(t)
        return ops.allgather(data, comm=self.comm, async_op=True, timeout=self.timeout_s)

    def _check_root(self, root: int, op: str) -> int:
        if not 0 <= root < self.comm.size:
            raise MPXValueError(f"{op}: root must be a rank in [0, {self.comm.size}), got {root}")
        return root

    # -- reductions -------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> MPXWork:  # type: ignore[override]
        """``allreduce(tensors, AllreduceOptions)``, or ``allreduce(tensor, op=ReduceOp)``."""
        opts = op if op is not None else opts
        tensors = _all_of(tensors)
        name = self.reduce_op_name(opts, "allreduce")
        if len(tensors) == 1 and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors[0], name)
        versions = versions_as_gloo(tensors)
        # Several tensors (torch's multi-device form): one value over all of them.
        forms = [reduce_form(t, name, "allreduce") for t in tensors]
        combined = forms[0]
        if len(forms) > 1:
            combined = ReduceForm(tensors[0], _fold_local(forms), forms[0].op)
        handle = self._allreduce_form(combined)
        if len(forms) == 1 and combined.tensor is combined.original:
            # DDP's bucket: reduced in its own memory, nothing to write back.
            return self._work([handle], tensors, versions=versions)

        def write_back() -> None:
            for form in forms:
                if form is not combined:
                    form.tensor.copy_(combined.tensor)
                form.write_back()

        return self._work([handle], tensors, write_back, versions=versions)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> MPXWork:
        """Each tensor reduced once, from its value before the call (as gloo's flat buffer)."""
        op = self.reduce_op_name(opts, "allreduce_coalesced")
        versions = versions_as_gloo(tensors, 1)  # gloo copies each out of its flat buffer
        forms = [reduce_form(t, op, "allreduce_coalesced") for t in tensors]
        if _share_memory([form.tensor for form in forms]):
            # One tensor twice in the list, or overlapping views: reduced in place,
            # the shared elements would be reduced twice. Reduce copies instead and
            # write them back in order, as gloo does through its flat buffer.
            forms = [ReduceForm(form.original, form.tensor.clone(), form.op) for form in forms]
        handles = [self._allreduce_form(form) for form in forms]

        def write_back() -> None:
            for form in forms:
                form.write_back()

        return self._work(handles, tensors, write_back, versions=versions)

    def reduce(self, tensors: Any, opts: Any = None) -> MPXWork:  # type: ignore[override]
        tensors = _all_of(tensors)
        op = self.reduce_op_name(opts, "reduce")
        root = self._check_root(opts.rootRank if opts is not None else 0, "reduce")
        versions = versions_as_gloo(tensors)
        form = reduce_form(tensors[0], op, "reduce")
        if op in BITWISE:  # reduced on every rank, into a scratch copy off the root
            form = ReduceForm(tensors[0], form.tensor.clone(), op)
            handle: Any = self._allreduce_form(form)
        else:
            handle = ops.reduce(
                form.tensor, root, form.op, comm=self.comm, async_op=True, timeout=self.timeout_s
            )

        def write_back() -> None:
            if self.comm.rank == root:
                form.write_back()

        return self._work([handle], tensors, write_back, versions=versions)

    def _reduce_scatter_rows(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: str, where: str
    ) -> tuple[Handle[torch.Tensor], Callable[[], None]]:
        """Block r of ``inputs`` reduced into rank r's ``outputs[0]``; blocks may differ in size."""
        size = self.comm.size
        if len(inputs) != size:
            raise MPXValueError(
                f"{where}: needs one input tensor per rank ({size}), got {len(inputs)}"
            )
        forms = [reduce_form(t, op, where) for t in inputs]
        widest = max(form.tensor.numel() for form in forms)
        stacked = torch.zeros(
            (size, widest), dtype=forms[0].tensor.dtype, device=forms[0].tensor.device
        )
        for row, form in zip(stacked, forms, strict=True):
            row[: form.tensor.numel()] = form.tensor.reshape(-1)
        out = reduce_form(outputs[0], op, where)
        mine = out.tensor.numel()
        if forms[0].op in BITWISE:
            whole = self._allreduce_form(ReduceForm(stacked, stacked, forms[0].op))

            def take_bitwise() -> None:
                out.tensor.reshape(-1).copy_(whole.wait()[self.comm.rank, :mine])
                out.write_back()

            return whole, take_bitwise
        handle = ops.reduce_scatter(
            stacked, forms[0].op, comm=self.comm, async_op=True, timeout=self.timeout_s
        )

        def take() -> None:
            out.tensor.reshape(-1).copy_(handle.wait()[0, :mine])
            out.write_back()

        return handle, take

    def reduce_scatter(  # type: ignore[override]
        self, outputs: Any, input_lists: Any, opts: Any = None
    ) -> MPXWork:
        outputs = _all_of(outputs)
        if input_lists and isinstance(input_lists[0], torch.Tensor):
            input_lists = [input_lists]
        op = self.reduce_op_name(opts, "reduce_scatter")
        versions = versions_as_gloo(outputs, 1)  # gloo copies each out of its buffer
        steps = [
            self._reduce_scatter_rows([out], list(inputs), op, "reduce_scatter")
            for out, inputs in zip(outputs, input_lists, strict=True)
        ]
        then = _in_turn([then for _, then in steps])
        return self._work([h for h, _ in steps], outputs, then, versions=versions)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> MPXWork:
        op = self.reduce_op_name(opts, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.comm.size:
            raise MPXValueError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, not "
                f"{self.comm.size} x the output's {output.numel()}"
            )
        versions = versions_as_gloo([output], 1)
        blocks = list(_rows(input.contiguous(), self.comm.size))
        handle, then = self._reduce_scatter_rows([output], blocks, op, "reduce_scatter_tensor")
        return self._work([handle], [output], then, versions=versions)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        works = [
            self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._joined(works, outputs)

    def _sparse_allreduce(self, t: torch.Tensor, op: str) -> MPXWork:
        """Sums sparse COO tensors as gloo does: every rank's entries, coalesced."""
        if op != "sum":
            raise MPXValueError(
                f"allreduce: a sparse tensor can only be summed, got {op!r}; use SUM"
            )
        local = t.coalesce()
        indices, values = local.indices().contiguous(), local.values().contiguous()
        counts = ops.allgather(
            torch.tensor([indices.shape[1]], dtype=torch.int64),
            comm=self.comm,
            timeout=self.timeout_s,
        )
        widest = int(counts.max())
        padded_i = torch.zeros((indices.shape[0], widest), dtype=torch.int64)
        padded_i[:, : indices.shape[1]] = indices
        padded_v = torch.zeros((widest, *values.shape[1:]), dtype=values.dtype)
        padded_v[: values.shape[0]] = values
        all_i = ops.allgather(padded_i, comm=self.comm, timeout=self.timeout_s)
        all_v = self._allgather_bytes(padded_v).wait()
        all_v = all_v.view(values.dtype).reshape(self.comm.size, *padded_v.shape)
        keep = [int(n) for n in counts.reshape(-1)]
        summed = torch.sparse_coo_tensor(
            torch.cat([all_i[r][:, :n] for r, n in enumerate(keep)], dim=1),
            torch.cat([all_v[r][:n] for r, n in enumerate(keep)]),
            t.shape,
            check_invariants=False,  # built from valid tensors: skip the check and its warning
        ).coalesce()
        t.copy_(summed)
        return self._work([], [t])

    # -- data movement ---------------------------------------------------------------

    def broadcast(  # type: ignore[override]
        self, tensors: Any, opts: Any = None, root: int | None = None
    ) -> MPXWork:
        """``broadcast(tensors, BroadcastOptions)``, or ``broadcast(tensor, root)``."""
        opts = root if root is not None else opts
        tensors = _all_of(tensors)
        if isinstance(opts, int):  # pg.broadcast(tensor, root)
            root, index = opts, 0
        else:
            root = opts.rootRank if opts is not None else 0
            index = opts.rootTensor if opts is not None else 0
        self._check_root(root, "broadcast")
        versions = versions_as_gloo(tensors[index : index + 1])  # the others: copied, as gloo
        data, write_back = bytes_of(tensors[index])
        handle = ops.broadcast(data, root, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def then() -> None:
            write_back()
            for i, t in enumerate(tensors):
                if i != index:
                    t.copy_(tensors[index])

        return self._work([handle], tensors, then, versions=versions)

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> MPXWork:
        """c10d's form: ``k`` inputs per rank, ``k`` output lists of ``size * k`` tensors.

        As gloo: every output list receives every rank's every input,
        ``output_lists[i][r * k + j]`` = rank r's ``inputs[j]``.
        """
        inputs = _all_of(inputs)
        if output_lists and isinstance(output_lists[0], torch.Tensor):
            output_lists = [output_lists]
        k, size = len(inputs), self.comm.size
        if len(output_lists) != k:
            raise MPXValueError(
                f"all_gather: needs one output list per input tensor ({k}), got "
                f"{len(output_lists)} (c10d's form: allgather(output_lists, inputs))"
            )
        for outputs in output_lists:
            if len(outputs) != size * k and k == 1:
                raise MPXValueError(
                    f"all_gather: needs one output tensor per rank ({size}), got {len(outputs)}"
                )
            if len(outputs) != size * k:
                raise MPXValueError(
                    f"all_gather: each output list needs world size x inputs = {size} x {k} = "
                    f"{size * k} tensors (output[r * {k} + j] receives rank r's input j), "
                    f"got {len(outputs)}"
                )
        flat = [t for outs in output_lists for t in outs]
        versions = versions_as_gloo(flat, 1)  # gloo copies each out of its buffer
        handles = [self._allgather_bytes(t) for t in inputs]

        def scatter_rows() -> None:
            for j, handle in enumerate(handles):
                gathered = handle.wait()
                for outputs in output_lists:
                    _copy_rows(gathered, outputs[j::k], "all_gather")

        # gloo's future: the output list itself for one input, else one list per input.
        nested = None if k == 1 else [list(outputs) for outputs in output_lists]
        return self._work(handles, flat, scatter_rows, versions=versions, value=nested)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        # torch's order: output_lists[rank][i] receives rank's inputs[i].
        flat = [t for outs in output_lists for t in outs]
        versions = versions_as_gloo(flat, 1)  # gloo copies each out of its buffer
        handles = [self._allgather_bytes(t) for t in inputs]

        def scatter_rows() -> None:
            for i, handle in enumerate(handles):
                _copy_rows(
                    handle.wait(), [outs[i] for outs in output_lists], "all_gather_coalesced"
                )

        # gloo's future: one list per rank, as given (the one list itself at one rank).
        nested = None if len(output_lists) == 1 else [list(outs) for outs in output_lists]
        return self._work(handles, flat, scatter_rows, versions=versions, value=nested)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> MPXWork:
        if output.numel() != input.numel() * self.comm.size:
            raise MPXValueError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, not "
                f"{self.comm.size} x the input's {input.numel()}"
            )
        # gloo copies each rank's block into the output's chunk: one bump per rank
        versions = versions_as_gloo([output], self.comm.size)
        handle = self._allgather_bytes(input)
        target, write_back = bytes_of(output)

        def then() -> None:
            target.copy_(handle.wait().reshape(-1))
            write_back()

        return self._work([handle], [output], then, versions=versions)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        works = [self._allgather_base(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._joined(works, outputs)

    def gather(  # type: ignore[override]
        self, output_lists: Any, inputs: Any, opts: Any = None
    ) -> MPXWork:
        inputs = _all_of(inputs)
        root = self._check_root(opts.rootRank if opts is not None else 0, "gather")
        if self.comm.rank == root and (not output_lists or len(output_lists[0]) != self.comm.size):
            raise MPXValueError(f"gather: the root needs a gather_list of {self.comm.size} tensors")
        outputs = list(output_lists[0]) if output_lists else []
        versions = versions_as_gloo(outputs, 1)  # gloo copies each out of its buffer
        handle = self._allgather_bytes(inputs[0])

        def then() -> None:
            if self.comm.rank == root:
                _copy_rows(handle.wait(), output_lists[0], "gather")

        return self._work([handle], outputs, then, versions=versions)

    def scatter(  # type: ignore[override]
        self, outputs: Any, input_lists: Any, opts: Any = None
    ) -> MPXWork:
        outputs = _all_of(outputs)
        root = self._check_root(opts.rootRank if opts is not None else 0, "scatter")
        versions = versions_as_gloo(outputs)
        target, write_back = bytes_of(outputs[0])
        whole = torch.empty((self.comm.size, target.numel()), dtype=torch.uint8)
        if self.comm.rank == root:
            if not input_lists or len(input_lists[0]) != self.comm.size:
                raise MPXValueError(
                    f"scatter: the root needs a scatter_list of {self.comm.size} tensors"
                )
            for row, t in zip(whole, input_lists[0], strict=True):
                row.copy_(bytes_of(t)[0])
        handle = ops.broadcast(whole, root, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def then() -> None:
            target.copy_(whole[self.comm.rank])
            write_back()

        return self._work([handle], outputs, then, versions=versions)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> MPXWork:
        size = self.comm.size
        versions = versions_as_gloo([output])  # gloo receives into it
        # c10d's contract, as gloo checks it: the input is whole in its memory format
        # (a strided output is accepted, and written through a copy).
        if not _dense(input):
            raise MPXValueError(
                f"all_to_all_single: Tensors must be contiguous; the input has strides "
                f"{input.stride()} for shape {tuple(input.shape)}: pass input.contiguous()"
            )
        if not input_split_sizes and not output_split_sizes:
            if input.numel() % size:
                raise MPXValueError(
                    f"all_to_all_single: {input.numel()} elements do not split evenly over "
                    f"{size} ranks; pass input_split_sizes and output_split_sizes"
                )
            data, _ = bytes_of(input)
            target, write_back = bytes_of(output)
            handle = ops.alltoall(
                _rows(data, size), comm=self.comm, async_op=True, timeout=self.timeout_s
            )

            def even() -> None:
                target.copy_(handle.wait().reshape(-1))
                write_back()

            return self._work([handle], [output], even, versions=versions)
        rows_in = input_split_sizes or [input.shape[0] // size] * size
        rows_out = output_split_sizes or [output.shape[0] // size] * size
        send = list(torch.split(input, rows_in)) if input.dim() else [input]
        receive = list(torch.split(output, rows_out)) if output.dim() else [output]
        return self._alltoall(receive, send, versions)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        # gloo copies each output out of its buffer
        return self._alltoall(outputs, inputs, versions_as_gloo(outputs, 1))

    def _alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], versions: Callable[[], None]
    ) -> MPXWork:
        size = self.comm.size
        if len(inputs) != size or len(outputs) != size:
            raise MPXValueError(
                f"all_to_all: needs {size} input and output tensors, got "
                f"{len(inputs)} and {len(outputs)}"
            )
        # Blocks may differ in size: each travels padded to the largest of the job.
        sizes = [t.numel() * t.element_size() for t in inputs]
        widest = ops.allreduce(
            torch.tensor([max(sizes)], dtype=torch.int64),
            "max",
            comm=self.comm,
            timeout=self.timeout_s,
        )
        blocks = torch.zeros((size, int(widest)), dtype=torch.uint8)
        for row, t, n in zip(blocks, inputs, sizes, strict=True):
            row[:n] = bytes_of(t)[0]
        handle = ops.alltoall(blocks, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def unpad() -> None:
            received = handle.wait()
            for row, out in zip(received, outputs, strict=True):
                target, write_back = bytes_of(out)
                target.copy_(row[: target.numel()])
                write_back()

        return self._work([handle], outputs, unpad, versions=versions)

    # -- point to point ------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> MPXWork:
        data, _ = bytes_of(tensors[0])
        handle = ops.send(data, dstRank, tag, comm=self.comm, async_op=True, timeout=self.timeout_s)
        return self._work([handle], tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> MPXWork:
        versions = versions_as_gloo(tensors)
        target, write_back = bytes_of(tensors[0])
        handle = ops.recv(
            target, srcRank, tag, comm=self.comm, async_op=True, timeout=self.timeout_s
        )
        return self._work([handle], tensors, write_back, lambda: srcRank, versions)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> MPXWork:
        versions = versions_as_gloo(tensors)
        target, write_back = bytes_of(tensors[0])
        request = _MPIRequest(
            self.comm.mpi.Irecv(numpy_view(target), source=MPI.ANY_SOURCE, tag=tag), self.timeout_s
        )
        return self._work([request], tensors, write_back, request.source, versions)  # type: ignore[list-item]

    def barrier(self, opts: Any = None) -> MPXWork:
        return self._work([ops.barrier(comm=self.comm, async_op=True, timeout=self.timeout_s)], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        raise MPXTypeError(
            "monitored_barrier: torch implements it for gloo only; on mpx use dist.barrier() "
            "(it raises CollectiveTimeout naming the ranks behind after the group's timeout)"
        )

    # -- options -------------------------------------------------------------------------

    @staticmethod
    def reduce_op_name(opts: Any, where: str) -> str:
        """mpx's name of the ReduceOp in torch's options (or a bare ReduceOp); sum if None."""
        if opts is None:
            return "sum"
        return reduce_op(getattr(opts, "reduceOp", opts), where)

    @classmethod
    def create(cls, options: Any, backend_options: Any = None) -> MPXProcessGroup:
        """torch's creator (``register_backend(..., extended_api=True)``) for this class.

        ``options`` is torch's ``_DistributedBackendOptions``: this rank's place
        in the group, its global ranks and its timeout.
        """
        seconds = None if options.timeout is None else options.timeout.total_seconds()
        comm = _group_communicator(options.global_ranks_in_group, seconds)
        rank, size = options.group_rank, options.group_size
        if (rank, size) != (comm.rank, comm.size):
            comm.free()
            raise MPXValueError(
                f"torch asked for rank {rank} of {size}, but MPI says rank {comm.rank} of "
                f"{comm.size}; start the job with mpxrun/mpiexec and let mpx.collectives."
                "init_process_group() pass MPI's rank and size"
            )
        return cls(comm, options.timeout)

    # torch 2.13's names of the single-tensor forms (all_gather_into_tensor,
    # reduce_scatter_tensor and all_to_all_single call these).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]


class _Deferred:
    """A handle whose result is computed from another's when it is waited for."""

    def __init__(self, inner: Handle[Any], compute: Callable[[], torch.Tensor]) -> None:
        self._inner, self._compute = inner, compute
        self._value: torch.Tensor | None = None

    def wait(self, timeout: float | None = None) -> torch.Tensor:
        if self._value is None:
            self._inner.wait(timeout)
            self._value = self._compute()
        return self._value

    def done(self) -> bool:
        return self._inner.done()


def _in_turn(calls: Sequence[Callable[[], object]]) -> Callable[[], None]:
    """One completion step that runs each of ``calls`` in order."""

    def run() -> None:
        for call in calls:
            call()

    return run


def _share_memory(tensors: Sequence[torch.Tensor]) -> bool:
    """True if two of ``tensors`` use the same storage (the same tensor, or views of one)."""
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage().data_ptr()
        if storage in seen and t.numel():
            return True
        if t.numel():
            seen.add(storage)
    return False


def _fold_local(forms: list[ReduceForm]) -> torch.Tensor:
    """The tensors of one rank reduced together (torch's several-tensors-per-call form)."""
    out = forms[0].tensor.clone()
    for form in forms[1:]:
        other = form.tensor
        if form.op in ("sum", "avg"):
            out += other
        elif form.op == "max":
            out = torch.maximum(out, other)
        elif form.op == "min":
            out = torch.minimum(out, other)
        elif form.op == "prod":
            out *= other
        else:
            out = BITWISE[form.op](out, other)
    if forms[0].op == "avg":
        out /= len(forms)
    return out


def _copy_rows(stacked: torch.Tensor, outputs: Sequence[torch.Tensor], where: str) -> None:
    """Row r of the gathered bytes into ``outputs[r]``."""
    for row, out in zip(_rows(stacked, len(outputs)), outputs, strict=True):
        target, write_back = bytes_of(out)
        if target.numel() != row.numel():
            raise MPXValueError(
                f"{where}: output tensor of {out.numel()} {out.dtype} elements does not match "
                f"the {row.numel()} bytes each rank sent; give every rank the same shape"
            )
        target.copy_(row)
        write_back()


def _group_communicator(ranks: Sequence[int], timeout: float | None) -> Communicator:
    """A communicator of its own for a group of world ranks, made by its members alone.

    torch creates a group only on its members, so the communicator comes
    from ``MPI_Comm_create_group`` (collective over them), not a split of
    the world. Being the group's own, its FIFO keeps the group's operations
    apart from other groups' and from mpx's own calls on :func:`world`, and
    a timeout that breaks it breaks no other group.
    """
    parent = MPI.COMM_WORLD
    members = list(ranks) if ranks else list(range(parent.Get_size()))
    group = parent.Get_group().Incl(members)
    try:
        mpi_comm = parent.Create_group(group, tag=0)
    finally:
        group.Free()
    return Communicator(MPI.Intracomm(mpi_comm), timeout)


def _create(options: Any, backend_options: Any = None) -> MPXProcessGroup:
    return MPXProcessGroup.create(options, backend_options)


def register_torch_backend() -> None:
    """Registers ``"mpx"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"]
        )
    _note_builtin_hooks()


def _note_builtin_hooks() -> None:
    """DDP's registration of a built-in comm hook marks an mpx group as read by C++ (idempotent).

    The built-in hooks run in C++ and read the allreduce's future as a c10
    tensor list (:meth:`MPXProcessGroup.cpp_reads_lists`); DDP registers them
    through a private Python method, which :mod:`mpx.collectives._torch_private`
    (the package's one user of torch's private APIs) listens to.
    """
    on_builtin_comm_hook(_reads_lists)


def _reads_lists(group: Any) -> None:
    if isinstance(group, MPXProcessGroup):
        group.cpp_reads_lists()


def init_process_group(init_method: str | None = None, timeout: timedelta | None = None) -> None:
    """``dist.init_process_group("mpx")`` with MPI's rank and size.

    Args:
        init_method: None for a process-local store (no TCP rendezvous needed;
            enough for every collective on the default group), or
            ``"env://"`` when other groups (``dist.new_group(backend="gloo")``)
            must rendezvous too (see ``mpx.launch.init_torch_env``).
        timeout: bounds every operation of the group (torch's default when None).
    """
    register_torch_backend()
    comm = world()
    extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    if init_method is None:
        dist.init_process_group(
            BACKEND_NAME,
            rank=comm.rank,
            world_size=comm.size,
            store=dist.HashStore(),  # type: ignore[attr-defined]
            **extra,
        )
    else:
        # Every rank must be done with the previous group before any rank
        # meets the store: a rank that connects while rank 0 still serves the
        # old group's store on the same MASTER_PORT counts itself there, and
        # rank 0's new store then waits for it until its timeout (a CI hang).
        # The previous group's store and gloo pairs may outlive it in reference
        # cycles (DDP's reducer, a work's callbacks): collected first, on every
        # rank, so that nobody finds the old group's keys or sockets.
        gc.collect()
        ops.barrier(comm=comm, timeout=None if timeout is None else timeout.total_seconds())
        # Some old groups cannot be collected (cycles through torch's C++, such
        # as a future's callbacks), and torch hands a new env:// store the old
        # TCPStore server of the same port while one is alive, keys included:
        # a new gloo group named like an old one ("1" again after destroy)
        # then read rank 0's old address and connected to its old listener (a
        # CI hang). Each world gets its own key space, named by rank 0.
        token = comm.allgather_object(secrets.token_hex(8) if comm.rank == 0 else None)[0]
        store, _, _ = next(
            dist.rendezvous(  # type: ignore[attr-defined]
                init_method, rank=comm.rank, world_size=comm.size, **extra
            )
        )
        dist.init_process_group(
            BACKEND_NAME,
            store=dist.PrefixStore(f"mpx-world-{token}", store),  # type: ignore[attr-defined]
            rank=comm.rank,
            world_size=comm.size,
            **extra,
        )
