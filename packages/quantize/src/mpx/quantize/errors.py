"""Errors of mpx-quantize.

Bad arguments raise :class:`QuantizeValueError` or :class:`QuantizeTypeError`,
which are also ``ValueError`` / ``TypeError``, so callers may catch either the
builtin or the package's base :class:`QuantizeError`.
"""

from __future__ import annotations

__all__ = ["QuantizeError", "QuantizeTypeError", "QuantizeValueError"]


class QuantizeError(Exception):
    """Base class of every mpx-quantize error."""


class QuantizeValueError(QuantizeError, ValueError):
    """An argument has the right type but a bad value (bits, bucket size, sizes)."""


class QuantizeTypeError(QuantizeError, TypeError):
    """An argument has the wrong type or dtype (integer or complex tensors)."""
