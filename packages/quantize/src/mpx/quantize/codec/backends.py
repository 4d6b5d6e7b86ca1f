"""Which compiled kernel backends this installation has."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["available_backends", "build_info"]

_EXTENSIONS = {"cpu": "mpx.quantize._cpu", "cuda": "mpx.quantize._cuda"}


def _load(backend: str) -> ModuleType | None:
    try:
        return importlib.import_module(_EXTENSIONS[backend])
    except ImportError:
        return None


def available_backends(usable_only: bool = False) -> list[str]:
    """Names of the compiled backends, in order of preference.

    Args:
        usable_only: also require a CUDA device for ``"cuda"``.

    Returns:
        A sublist of ``["cpu", "cuda"]``: ``"cuda"`` only when the CUDA
        extension was built (``MPX_QUANTIZE_CUDA=ON`` or ``AUTO`` with nvcc).
    """
    found = []
    for name in _EXTENSIONS:
        module = _load(name)
        if module is None:
            continue
        if name == "cuda" and usable_only and module.device_count() == 0:
            continue
        found.append(name)
    return found


def build_info() -> dict[str, dict[str, Any]]:
    """How each built extension was compiled (compiler, CUDA runtime version)."""
    info: dict[str, dict[str, Any]] = {}
    for name in _EXTENSIONS:
        module = _load(name)
        if module is not None:
            info[name] = dict(module.build_info())
    return info
