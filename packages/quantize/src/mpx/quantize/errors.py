"""Errors of mpx-quantize.

Bad arguments raise :class:`QuantizeValueError` or :class:`QuantizeTypeError`,
which are also ``ValueError`` / ``TypeError``, so callers may catch either the
builtin or the package's base :class:`QuantizeError`.

:class:`QuantizeError` derives from :class:`mpx.collectives.MPXError`, the root
of every mpx error, when mpx-collectives is installed. mpx-collectives is an
optional dependency of mpx-quantize (extra ``allreduce``): without it the
kernels still import, and :class:`QuantizeError` derives from ``Exception``
(there is then no ``MPXError`` anyone could catch). With it, importing
mpx-quantize imports mpx-collectives, and so mpi4py, which initializes MPI
(about 0.1 s on top of torch).
"""

from __future__ import annotations

try:
    from mpx.collectives import MPXError as _Base
except ImportError:  # mpx-collectives is optional: the kernels need only torch
    _Base = Exception  # type: ignore[misc,assignment]

__all__ = ["QuantizeError", "QuantizeTypeError", "QuantizeValueError"]


class QuantizeError(_Base):
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
