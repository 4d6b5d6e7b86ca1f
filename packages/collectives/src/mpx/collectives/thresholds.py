"""The size thresholds that ``auto`` and the composed algorithms share."""

from __future__ import annotations

import os

__all__ = ["small_bytes"]


def small_bytes() -> int:
    """Below this many bytes (``MPX_AUTO_SMALL_BYTES``, 256 KiB) MPI's own collectives win."""
    return int(os.environ.get("MPX_AUTO_SMALL_BYTES", str(256 << 10)))
