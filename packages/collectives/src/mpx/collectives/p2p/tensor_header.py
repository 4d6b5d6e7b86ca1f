"""A tensor's shape and dtype as ten int64: what a receiver needs to allocate its buffer.

``recv`` writes into a tensor the receiver made, so a sender whose shapes vary
sends a header first::

    index   0            1      2 .. 9
    value   dtype code   ndim   dims (zero beyond ndim)

The dtype code is the position in :data:`mpx.collectives.base.dtypes.SUPPORTED_DTYPES`,
then ``torch.bool`` (a mask travels as its bytes, uint8). Used by
:class:`mpx.collectives.Channel`'s headers (and published in
:mod:`mpx.collectives.building_blocks`).
"""

from __future__ import annotations

import torch

from mpx.collectives.base import SUPPORTED_DTYPES, MPXTypeError, MPXValueError

__all__ = ["HEADER_LEN", "MAX_HEADER_DIMS", "decode_header", "encode_header"]

MAX_HEADER_DIMS = 8
HEADER_LEN = 2 + MAX_HEADER_DIMS
# What a header may describe: the dtypes every operation takes, then bool (sent as uint8).
_CODES = (*SUPPORTED_DTYPES, torch.bool)


def encode_header(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``[dtype code, ndim, dim0, ..., dim7]`` as an int64 CPU tensor of :data:`HEADER_LEN`.

    Raises:
        MPXValueError: more than :data:`MAX_HEADER_DIMS` dimensions.
        MPXTypeError: a dtype outside ``SUPPORTED_DTYPES``.

    Example::

        header = encode_header(t.shape, t.dtype)
        send(header, peer, tag=1); send(t, peer, tag=2)
    """
    if len(shape) > MAX_HEADER_DIMS:
        raise MPXValueError(
            f"a tensor of shape {tuple(shape)} has more than {MAX_HEADER_DIMS} dimensions; "
            "flatten it (t.flatten(start_dim=...)) before sending it"
        )
    if dtype not in _CODES:
        raise MPXTypeError(
            f"a tensor of dtype {dtype} cannot be sent; supported: "
            f"{', '.join(map(str, _CODES))} (convert with t.to(...))"
        )
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0], header[1] = _CODES.index(dtype), len(shape)
    header[2 : 2 + len(shape)] = torch.tensor(list(shape), dtype=torch.int64)
    return header


def decode_header(header: torch.Tensor) -> tuple[torch.Size, torch.dtype]:
    """The shape and dtype that :func:`encode_header` wrote into ``header``.

    Raises:
        MPXValueError: ``header`` holds no header (a dtype code, ndim or dim out of
            range: e.g. a tensor's data where a header was expected).
    """
    code, ndim = int(header[0]), int(header[1])
    dims = [int(d) for d in header[2 : 2 + ndim]] if 0 <= ndim <= MAX_HEADER_DIMS else [-1]
    if not 0 <= code < len(_CODES) or min(dims, default=0) < 0:
        raise MPXValueError(
            f"not a tensor header (encode_header): dtype code {code}, ndim {ndim}, "
            f"dims {dims}; the sender and the receiver are out of step"
        )
    return torch.Size(dims), _CODES[code]
