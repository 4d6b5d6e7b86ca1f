"""The one module of mpx-collectives that touches private torch APIs.

Gloo: ``ProcessGroupGloo._Options`` binds a group's transport to one address
(:func:`gloo_process_group`, for the ``gloo`` implementation).

CUDA IPC: torch exports a CUDA allocation as a tuple of handles
(``UntypedStorage._share_cuda_``) and maps a peer's with
``UntypedStorage._new_shared_cuda`` (what ``torch.multiprocessing`` does for
CUDA tensors). Both exist, with these names, from torch 1.x to 2.13.

Version counters: ``torch._C._autograd._unsafe_set_version_counter`` sets
tensors' version counters (what ``torch.autograd._unsafe_preserve_version_counter``
does on exit); it takes sequences of tensors and versions from torch 2.3 to 2.13.

DDP's built-in comm hooks: ``DistributedDataParallel._register_builtin_comm_hook``
is where a DDP hands its group to C++ hooks that read futures as c10 tensor
lists (:func:`on_builtin_comm_hook` hears of it). Private in torch since 1.8,
with this name and signature to 2.13.

One private name lives elsewhere, for a reason: torch's rendezvous handler table
(``torch.distributed.rendezvous._rendezvous_handlers``), whose ``env`` entry
``mpx._collectives_autoload`` wraps when ``import torch`` loads the backend. That
module sits outside this package because importing this package starts MPI, which
``import torch`` must not.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch

from mpx.collectives.base.errors import MPXValueError

__all__ = [
    "export_cuda_storage",
    "gloo_process_group",
    "on_builtin_comm_hook",
    "open_cuda_storage",
    "set_versions",
]


def export_cuda_storage(t: torch.Tensor) -> tuple[Any, ...]:
    """A picklable handle for the CUDA memory of ``t`` (whole storage, offset 0)."""
    if not t.is_cuda:
        raise MPXValueError(
            f"CUDA IPC needs a CUDA tensor, got one on {t.device}; move it with .cuda()"
        )
    storage: Any = t.untyped_storage()
    return tuple(storage._share_cuda_())


def open_cuda_storage(handle: tuple[Any, ...]) -> torch.UntypedStorage:
    """Maps a peer's exported CUDA storage into this process."""
    storage_class: Any = torch.UntypedStorage
    return storage_class._new_shared_cuda(*handle)  # type: ignore[no-any-return]


def set_versions(tensors: tuple[torch.Tensor, ...], versions: tuple[int, ...]) -> None:
    """Sets each of ``tensors``' version counter (``t._version``) to its entry of ``versions``."""
    autograd: Any = torch._C._autograd  # not in torch's stubs
    autograd._unsafe_set_version_counter(tensors, versions)


def gloo_process_group(
    store: Any, rank: int, size: int, timeout: datetime.timedelta, hostname: str
) -> Any:
    """A ``ProcessGroupGloo`` over ``store`` whose transport binds ``hostname``.

    ``ProcessGroupGloo._Options`` (its ``_devices`` and ``_timeout``) is the
    only way to name the interface without ``GLOO_SOCKET_IFNAME``; it has had
    these names since torch 1.8.
    """
    import torch.distributed

    dist: Any = torch.distributed  # _Options is not in torch's stubs
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


# Who hears of a built-in comm hook's registration, in order; the wrapper is installed once.
_HOOK_LISTENERS: list[Callable[[Any], None]] = []
_HOOK_LOCK = threading.Lock()


def on_builtin_comm_hook(listener: Callable[[Any], None]) -> None:
    """From now on ``listener(process_group)`` runs as a DDP registers a built-in comm hook.

    It runs before torch registers the hook, with the DDP's
    ``process_group``. Idempotent: a listener already installed is not added
    again, and torch's method is wrapped once however often this is called.
    """
    with _HOOK_LOCK:
        if listener not in _HOOK_LISTENERS:
            _HOOK_LISTENERS.append(listener)
        ddp_class: Any = torch.nn.parallel.DistributedDataParallel
        original = ddp_class._register_builtin_comm_hook
        if getattr(original, "_mpx_listened", False):
            return

        def register(self: Any, comm_hook_type: Any) -> Any:
            for heard in list(_HOOK_LISTENERS):
                heard(self.process_group)
            return original(self, comm_hook_type)

        register._mpx_listened = True  # type: ignore[attr-defined]
        register.__doc__ = original.__doc__
        ddp_class._register_builtin_comm_hook = register
