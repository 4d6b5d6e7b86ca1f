"""The process group's classes run eagerly under ``torch.compile`` (dynamo).

torch's C++ calls the Python overrides of :class:`~mpx.collectives.torch.backend.MPXWork`
and :class:`~mpx.collectives.torch.backend.MPXProcessGroup` from inside
compiled code, and dynamo must not try to compile them (:func:`run_eagerly`);
a work's ``get_future`` must also tell torch's C++ from Python callers
(:func:`called_from_cpp`), through the wrappers that this adds. Only public
torch APIs here (``torch.compiler.disable``); the private ones stay in
:mod:`mpx.collectives.base._torch_private`.
"""

from __future__ import annotations

import sys
import threading
import types
from typing import Any, TypeVar

import torch

__all__ = ["called_from_cpp", "make_eager", "run_eagerly"]

_Class = TypeVar("_Class")


def called_from_cpp() -> bool:
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
        caller = caller.f_back  # torch.compiler.disable's wrapper (run_eagerly)
    return caller is None or "get_future" not in caller.f_code.co_names


def run_eagerly(cls: type[_Class]) -> type[_Class]:
    """Marks ``cls``: the methods torch calls are wrapped in ``torch.compiler.disable``.

    torch's C++ calls these Python overrides from inside compiled code
    (``torch.compile(DDP(m))``: the reducer's bucket rebuild broadcasts), and
    dynamo then tries to compile their frames, with ``self`` as an opaque
    process group whose Python members it does not know (``Member
    '_check_root' is not registered``). Run eagerly, as gloo's C++ methods
    are. Only torch's entry points are wrapped: each wrapper costs ~1.5 us.
    The wrapping waits for the first group (:func:`make_eager`):
    ``torch.compiler.disable`` imports ``torch._dynamo``, 1.4 s of every
    rank's start-up when done at import, in jobs that never make a group.
    """
    _EAGER_CLASSES.append(cls)
    return cls


def make_eager() -> None:
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
        _EAGER_WRAPPER_FILE.append(disable(make_eager).__code__.co_filename)


_EAGER_CLASSES: list[type[Any]] = []
_EAGER_LOCK = threading.Lock()
# The file of torch.compiler.disable's wrapper, once make_eager has run.
_EAGER_WRAPPER_FILE: list[str] = []
