"""What a rank averages across the replica groups, as its hello describes it.

Rank ``r`` of every group exchanges its gradients with rank ``r`` of the others:
if their number of elements, dtype or compression differ, no exchange can ever
succeed (a frame of another length is refused as a lost peer: every step would
be discarded, for ever; through shared memory, compressed and plain parts would
be mixed). The lighthouse (:mod:`mpx.launch.recovery.lighthouse`) checks each
hello's description with :func:`checked_gradients` and names a mismatch with
:func:`described`. Nothing here imports torch: it runs in ``mpxrun``.
"""

from __future__ import annotations

import re
from typing import Any

__all__ = ["checked_gradients", "described"]

_COMPRESSION = ("bits", "bucket_size", "stochastic")


def _bounded(fields: dict[str, Any], name: str, low: int, high: int) -> None:
    value = fields[name]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value < high:
        raise ValueError(f"gradients' {name}={value!r}, not an integer in [{low}, {high})")


def checked_gradients(value: object) -> dict[str, Any]:
    """``value`` if it is a description a member sends: exactly ``numel``, ``dtype`` and
    ``compression`` (null, or exactly ``bits``, ``bucket_size``, ``stochastic``), each
    bounded; else ValueError saying what is wrong (the hello is then refused)."""
    if not isinstance(value, dict) or set(value) != {"numel", "dtype", "compression"}:
        raise ValueError(f"gradients={value!r}, not {{numel, dtype, compression}}")
    _bounded(value, "numel", 0, 1 << 62)
    dtype = value["dtype"]
    if not isinstance(dtype, str) or not re.fullmatch(r"[0-9A-Za-z_.]{1,32}", dtype):
        raise ValueError(f"gradients' dtype={dtype!r}, not a dtype's name")
    compression = value["compression"]
    if compression is not None:
        if not isinstance(compression, dict) or set(compression) != set(_COMPRESSION):
            raise ValueError(
                f"gradients' compression={compression!r}, not null or "
                "{bits, bucket_size, stochastic}"
            )
        _bounded(compression, "bits", 1, 65)
        _bounded(compression, "bucket_size", 1, 1 << 40)
        if not isinstance(compression["stochastic"], bool):
            raise ValueError(f"gradients' stochastic={compression['stochastic']!r}, not a bool")
    return value


def described(gradients: dict[str, Any]) -> str:
    """A checked description in words, as a refusal names it."""
    compression = gradients["compression"]
    if compression is not None:
        fields = ", ".join(f"{k}={compression[k]}" for k in _COMPRESSION)
        compression = f"CompressionConfig({fields})"
    return (
        f"{gradients['numel']} trainable elements of dtype {gradients['dtype']}, "
        f"compression={compression}"
    )
