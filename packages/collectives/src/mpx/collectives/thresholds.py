"""The size thresholds that ``auto`` and the composed algorithms share."""

from __future__ import annotations

from mpx.collectives.settings import read_int

__all__ = ["small_bytes"]


def small_bytes() -> int:
    """Below this many bytes (``MPX_AUTO_SMALL_BYTES``, 256 KiB) MPI's own collectives win."""
    return read_int("MPX_AUTO_SMALL_BYTES", 256 << 10)
