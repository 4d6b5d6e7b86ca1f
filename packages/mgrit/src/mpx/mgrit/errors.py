"""The errors of mpx-mgrit: one base class, subclasses of the built-in kinds users catch."""

from __future__ import annotations

from mpx.collectives import MPXError

__all__ = ["MGRITConfigError", "MGRITError"]


class MGRITError(MPXError):
    """Base class of every error raised by mpx-mgrit."""


class MGRITConfigError(MGRITError, ValueError):
    """A bad argument: the message names the value and how to fix it."""
