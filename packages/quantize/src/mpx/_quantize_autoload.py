"""Registers the ``cgx`` torch.distributed backend when torch is imported.

The ``torch.backends`` entry point of mpx-quantize (see
``mpx._collectives_autoload`` for why it lives outside the package): the
creator imports :mod:`mpx.quantize.cgx.torch_backend`, and with it MPI, only
when a ``"cgx"`` group is made.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]

BACKEND_NAME = "cgx"  # mpx.quantize.cgx.torch_backend.BACKEND_NAME


def _create(options: Any, backend_options: Any = None) -> Any:
    from mpx.quantize.cgx.torch_backend import CGXProcessGroup  # here: see the docstring

    return CGXProcessGroup.create(options, backend_options)


def register() -> None:
    """Registers ``"cgx"`` lazily (idempotent; a no-op without torch.distributed)."""
    import torch.distributed as dist

    if not dist.is_available() or BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
