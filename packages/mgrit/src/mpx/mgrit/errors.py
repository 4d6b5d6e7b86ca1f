"""The errors of mpx-mgrit: one base class, subclasses of the built-in kinds users catch."""

from __future__ import annotations

from mpx.collectives import MPXError

__all__ = ["MGRITConfigError", "MGRITError"]


class MGRITError(MPXError):
    """Base class of every error raised by mpx-mgrit.

    Example::

        try: MGRIT(step, 0.0, 1.0, nt=100, levels=4)
        except MGRITError as err: print(err)   # nt=100 is not divisible by ... 8 ...
    """


class MGRITConfigError(MGRITError, ValueError):
    """A bad argument: the message names the value and how to fix it.

    Example::

        with pytest.raises(ValueError, match="cfactor=1"):
            MGRIT(step, 0.0, 1.0, nt=64, cfactor=1)
    """
