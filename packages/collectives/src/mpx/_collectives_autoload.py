"""Registers the ``mpx`` torch.distributed backend when torch is imported.

torch (2.4+) calls the entry points of group ``torch.backends`` at the end of
``import torch`` (``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off). This
module is that entry point of mpx-collectives. It lives beside the
``mpx.collectives`` package, not in it, because importing anything under
``mpx.collectives`` imports mpi4py, which initialises MPI: importing torch
must not. So it registers a creator that imports the backend, and with it
MPI, only when a process group is made::

    import torch.distributed as dist
    dist.init_process_group("mpx")      # no `import mpx.collectives` needed
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]

BACKEND_NAME = "mpx"  # mpx.collectives.torch_backend.BACKEND_NAME


def _create(options: Any, backend_options: Any = None) -> Any:
    from mpx.collectives import torch_backend  # here, not at import: see the docstring

    return torch_backend._create(options, backend_options)


def register() -> None:
    """Registers ``"mpx"`` lazily (idempotent; a no-op without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
