"""Errors of mpx-quantize.

Bad arguments raise :class:`QuantizeValueError` or :class:`QuantizeTypeError`,
which are also ``ValueError`` / ``TypeError``, so callers may catch either the
builtin or the package's base :class:`QuantizeError`.

:class:`QuantizeError` derives from :class:`MPXError`, the root of every mpx
error, which lives in the dependency-free mpx-launch (a requirement of
mpx-quantize): the kernels import without mpx-collectives, torch.distributed
or MPI, and ``except MPXError`` still catches their errors.
"""

from __future__ import annotations

from mpx.launch.errors import MPXError

__all__ = ["QuantizeError", "QuantizeTypeError", "QuantizeValueError"]


class QuantizeError(MPXError):
    """Base class of every mpx-quantize error.

    Example::

        try:
            mpx.quantize.quantize(x, bits=16)
        except mpx.quantize.QuantizeError as error:
            print(error)        # bits=16 must be an integer from 1 to 8
    """


class QuantizeValueError(QuantizeError, ValueError):
    """An argument has the right type but a bad value (bits, bucket size, sizes).

    Example::

        with pytest.raises(ValueError, match="bucket_size=0"):
            mpx.quantize.quantize(x, bucket_size=0)
    """


class QuantizeTypeError(QuantizeError, TypeError):
    """An argument has the wrong type or dtype (integer or complex tensors).

    Example::

        with pytest.raises(TypeError, match="torch.int64"):
            mpx.quantize.quantize(torch.arange(10))
    """
