"""The futures of the ``mpx`` torch backend: a wait drives its own operation.

torch chains code on a collective's future (``work.get_future().then(cb)``)
and that code may start another collective and wait for it: torch's PowerSGD
hook does, inside its callbacks, ``dist.all_reduce(p, async_op=True)
.get_future().wait()``. Callbacks run on the thread that completes the
future. If completing were the progress thread's job alone, a callback
running on it that waits would wait for itself (PowerSGD hung at its first
compressed step)::

    progress thread: bucket done -> callback -> all_reduce(P) -> wait ... forever
                                                                  (nobody left to drive P)

So a wait here drives the operation itself: :class:`MPXFuture` (what
``MPXWork.get_future()`` returns to Python) finishes its work in the waiting
thread -- it advances its handles, writes its outputs back and completes the
future, running the callbacks inline. A future chained on it with ``then`` is
torch's own (its errors are C++ errors, which DDP reads); chained inside a
callback, the operation is finished before ``then`` returns, so a wait on the
chain does not wait for the thread it runs on. The progress thread is then
one of several threads that can complete an operation, never the only one::

    progress thread: bucket done -> callback -> all_reduce(P) -> MPXFuture.wait()
                                                                  drives P itself, runs its
                                                                  callbacks, returns
                     ... and the nested callbacks may wait again, at any depth.

Why this, and not callbacks on other threads: callbacks that start
collectives must start them in the same order on every rank (collectives of
a communicator match by order). Waiting drives, so each callback chain runs
start to end on one thread in the order the operations complete, as it does
today; a pool of callback threads would let two buckets' callbacks interleave
their collectives differently on each rank. A wait torch makes in C++ inside
a callback (``torch.futures.wait_all``, ``collect_all(...).wait()``) cannot
be seen from Python and is not driven: call ``.wait()`` on each future.

C++ callers need another kind of future: torch's built-in comm hooks
(``BuiltinCommHookType.FP16_COMPRESS``) read the value as a c10 tensor list,
and a future completed from Python holds a Python object instead (torch:
``result.isTensorList() INTERNAL ASSERT FAILED``). :func:`tensor_list_future`
makes one whose value is a real tensor list: a TorchScript task forked on
torch's inter-op pool waits for the Python future and returns the tensors.
Only torch's C++ gets it (``MPXWork.get_future`` tells the callers apart), and
only on a group whose futures C++ reads as lists (a built-in hook registered:
``MPXProcessGroup.cpp_reads_lists``; DDP's own reduction reads the Python
future): it completes one inter-op hop (~65 us) after the Python future, and
calling the TorchScript task releases the GIL, which the progress thread may
then hold for a switch interval (DDP's step paid ~2 ms a bucket for it).
"""

# No `from __future__ import annotations`: TorchScript reads the annotations of
# the functions it compiles (and of _error_of, which it calls) as objects.
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["COMPLETING", "MPXFuture", "running_callbacks", "tensor_list_future"]

T = TypeVar("T")
S = TypeVar("S")


class MPXFuture(torch.futures.Future[T]):
    """A torch future whose :meth:`wait` finishes its operation in the waiting thread.

    Args:
        drive: finishes the operation (waits for it, completes the root future
            of the chain); called by :meth:`wait` before it blocks. Its errors
            are the future's to raise, so they are not raised here.

    Example::

        future = work.get_future()            # an MPXFuture
        doubled = future.then(lambda f: f.value()[0] * 2)
        doubled.wait()                        # drives the work itself
    """

    def __init__(self, drive: Callable[[], object]) -> None:
        super().__init__()
        self._drive = drive

    def wait(self) -> T:
        if not super().done():
            # The future carries the operation's error: wait() below raises it.
            with contextlib.suppress(BaseException):
                self._drive()
        return super().wait()

    def then(self, callback: Callable[[torch.futures.Future[T]], S]) -> torch.futures.Future[S]:
        """torch's ``then``; inside a callback of an mpx future, the operation is finished first.

        The future returned is torch's own (a callback's error fails it in C++,
        as DDP needs). torch waits on it in C++, where no wait can drive, so a
        chain made inside a callback -- ``f.then(g).wait()`` there would wait
        on the very thread that must complete ``f`` -- has ``f``'s operation
        finished by this thread before it is chained on.
        """
        if running_callbacks():
            with contextlib.suppress(BaseException):  # the future carries it
                self._drive()
        return super().then(callback)


_callbacks = threading.local()  # .depth: completions of mpx futures this thread is in


class _Completing:
    """``with COMPLETING:`` marks the current thread as running an mpx future's callbacks.

    Nestable. A class, not a generator context manager: every work a DDP
    step reduces passes through it on the progress thread (two Python calls
    instead of five).
    """

    __slots__ = ()

    def __enter__(self) -> None:
        _callbacks.depth = getattr(_callbacks, "depth", 0) + 1

    def __exit__(self, *exc_info: object) -> None:
        _callbacks.depth -= 1


COMPLETING = _Completing()


def running_callbacks() -> bool:
    """True on a thread that is completing an mpx future (so running its callbacks)."""
    return bool(getattr(_callbacks, "depth", 0))


# -- futures whose value is a c10 tensor list, for torch's C++ ---------------------------

_errors: dict[int, str] = {}  # key -> the error of the operation, until its task reads it
_keys = itertools.count(1)
_script: list[Any] = []  # the compiled TorchScript function, made on first use
_script_lock = threading.Lock()


@torch.jit.ignore  # type: ignore[untyped-decorator]
def _error_of(key: int) -> str:
    """The error of operation ``key`` ("" if it succeeded); called from the TorchScript task."""
    return _errors.pop(key, "")


# TorchScript reads comments that start with "type:" as its own annotations: the
# two functions below go through an untyped alias of torch.jit instead.
_jit: Any = torch.jit


def _when_done(
    signal: torch.futures.Future[int], key: int, tensors: list[torch.Tensor]
) -> list[torch.Tensor]:
    _jit.wait(signal)
    error = _error_of(key)
    if error != "":
        raise RuntimeError(error)
    return tensors


def _fork(
    signal: torch.futures.Future[int], key: int, tensors: list[torch.Tensor]
) -> torch.futures.Future[list[torch.Tensor]]:
    future: torch.futures.Future[list[torch.Tensor]] = _jit.fork(_when_done, signal, key, tensors)
    return future


def _compiled() -> Any:
    with _script_lock:
        if not _script:
            _script.append(torch.jit.script(_fork))
    return _script[0]


def tensor_list_future(
    tensors: list[torch.Tensor],
) -> tuple[torch.futures.Future[list[torch.Tensor]], Callable[[BaseException | None], None]]:
    """A future whose value will be ``tensors`` as a c10 tensor list, and what completes it.

    Returns:
        ``(future, complete)``: ``complete(None)`` completes the future with
        ``tensors``; ``complete(error)`` fails it with a ``RuntimeError``
        carrying the error's type and message. The future completes on one of
        torch's inter-op threads, shortly after ``complete`` is called.
    """
    key = next(_keys)
    signal: torch.futures.Future[int] = torch.futures.Future()
    future = _compiled()(signal, key, list(tensors))

    def complete(error: BaseException | None) -> None:
        if error is not None:
            _errors[key] = f"{type(error).__name__}: {error}"
        signal.set_result(0)

    return future, complete
