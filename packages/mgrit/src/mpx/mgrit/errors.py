"""The errors of mpx-mgrit: one base class, subclasses of the built-in kinds users catch.

:class:`MGRITError` derives from :class:`mpx.collectives.MPXError`. A bad
argument raises :class:`MGRITConfigError`, which is also a ``ValueError``; one
of the wrong type raises :class:`MGRITTypeError`, which is a ``TypeError`` and,
as these were ``MGRITConfigError`` before, still an ``MGRITConfigError`` and a
``ValueError``, so existing ``except`` clauses keep catching it.
"""

from __future__ import annotations

from mpx.collectives import MPXError

__all__ = ["MGRITConfigError", "MGRITError", "MGRITTypeError"]


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


class MGRITTypeError(MGRITConfigError, TypeError):
    """An argument of the wrong type (a step that is not callable, a state that is no tensor).

    Example::

        with pytest.raises(TypeError, match="u0 must be a torch.Tensor"):
            MGRIT(step, 0.0, 1.0, nt=64).solve([1.0])
    """
