"""The quantized format: :class:`QuantizedTensor` and its byte layout.

A tensor of ``n`` elements is flattened and cut into buckets of
``bucket_size`` values; each bucket keeps its ``min`` and ``unit`` (the step
between two levels) and every value a ``bits``-bit code::

    x (flattened)  |<- bucket 0 ->|<- bucket 1 ->| ... |<- last, maybe short ->|
    code           q = min(floor((x - min) / unit + r), 2^bits - 1)
    decoded        min + q * unit

All of a quantized tensor lives in one uint8 ``buffer`` (what goes on the
wire), in this order::

    +--------------+--------------+---------------------+------------------------+
    | mins  [nb] M | units [nb] M | tail [t] input dtype| values [ceil(nq/8)*b]  |
    +--------------+--------------+---------------------+------------------------+
    nq = quantized elements, nb = ceil(nq / bucket_size), t = n - nq
    M  = metadata dtype: float32 for float32 and bfloat16 input, float16 for float16

``t`` is non-zero only with ``skip_incomplete_buckets``: the short last bucket
is then kept raw (CGX's option). bfloat16 keeps its metadata in float32
because a bfloat16 unit (8-bit mantissa) would be off by up to half a level at
8 bits.

Codes are packed 8 at a time into ``bits`` bytes, little-endian: code ``j`` of
a group occupies bits ``j*b .. j*b+b-1`` of the group's ``8*b``-bit integer::

    bits=3:  byte 0          byte 1          byte 2
             22111000        54444333        77766655     (digit = code index)

A bucket holding NaN or +-Inf (or whose range max-min, or its unit, does not
fit the metadata dtype) is *flagged*: its ``min`` and ``unit`` are NaN and its
codes 0, so it decodes to NaN everywhere and no other bucket is affected.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mpx.quantize.errors import QuantizeTypeError, QuantizeValueError

__all__ = [
    "FLOAT_DTYPES",
    "MAX_BUCKET_SIZE",
    "Layout",
    "QuantizedTensor",
    "check_bits",
    "check_bucket_size",
    "check_dtype",
    "layout",
    "meta_dtype",
]

FLOAT_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float16, torch.bfloat16)


def check_bits(bits: object) -> int:
    """``bits`` as an int in 1..8, or a QuantizeValueError naming it."""
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 8:
        raise QuantizeValueError(f"bits={bits!r} must be an integer from 1 to 8")
    return bits


# The kernels take the bucket size as an int64 and compute spans of up to 8
# buckets (bucket_size * 8) in int64: 2**60 is the largest they accept. A bucket
# larger than the tensor is the whole tensor, so nothing is lost.
MAX_BUCKET_SIZE = 2**60


def check_bucket_size(bucket_size: object) -> int:
    """``bucket_size`` as an int in 1..2**60, or a QuantizeValueError naming it."""
    if (
        isinstance(bucket_size, bool)
        or not isinstance(bucket_size, int)
        or not 1 <= bucket_size <= MAX_BUCKET_SIZE
    ):
        raise QuantizeValueError(
            f"bucket_size={bucket_size!r} must be an integer from 1 to 2**60 "
            f"({MAX_BUCKET_SIZE}); a bucket_size >= the tensor's size makes it one bucket"
        )
    return bucket_size


def check_dtype(dtype: torch.dtype) -> torch.dtype:
    """``dtype`` if it is float32, float16 or bfloat16; else a QuantizeTypeError."""
    if dtype not in FLOAT_DTYPES:
        raise QuantizeTypeError(
            f"cannot quantize dtype {dtype}: use float32, float16 or bfloat16 "
            "(convert with .float() first)"
        )
    return dtype


def meta_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the per-bucket ``min`` and ``unit`` for input ``dtype``."""
    return torch.float16 if dtype == torch.float16 else torch.float32


@dataclass(frozen=True)
class Layout:
    """Sizes and byte offsets of the parts of a quantized buffer.

    Example::

        lay = layout(1000, torch.float32, bits=4, bucket_size=512)
        lay.buckets, lay.values_bytes, lay.nbytes      # (2, 500, 516)
    """

    numel: int
    quantized: int  # nq: elements that are quantized
    buckets: int  # nb
    tail: int  # t = numel - nq, raw elements
    mins_offset: int
    units_offset: int
    tail_offset: int
    values_offset: int
    values_bytes: int
    nbytes: int


def layout(
    numel: int, dtype: torch.dtype, bits: int, bucket_size: int, skip_incomplete: bool = False
) -> Layout:
    """The :class:`Layout` of ``numel`` elements quantized with these settings."""
    quantized = (numel // bucket_size) * bucket_size if skip_incomplete else numel
    buckets = -(-quantized // bucket_size)
    msize = torch.finfo(meta_dtype(dtype)).bits // 8
    esize = torch.finfo(dtype).bits // 8
    values_bytes = -(-quantized // 8) * bits
    units_offset = buckets * msize
    tail_offset = 2 * buckets * msize
    values_offset = tail_offset + (numel - quantized) * esize
    return Layout(
        numel=numel,
        quantized=quantized,
        buckets=buckets,
        tail=numel - quantized,
        mins_offset=0,
        units_offset=units_offset,
        tail_offset=tail_offset,
        values_offset=values_offset,
        values_bytes=values_bytes,
        nbytes=values_offset + values_bytes,
    )


class QuantizedTensor:
    """A tensor quantized in buckets: one uint8 ``buffer`` plus its header.

    Args:
        buffer: 1-D contiguous uint8 tensor laid out as the module docstring shows.
        shape: shape of the original tensor.
        dtype: dtype of the original tensor (float32, float16 or bfloat16).
        bits: bits per code, 1 to 8.
        bucket_size: values per bucket, >= 1.
        skip_incomplete_buckets: the short last bucket is kept raw.

    Raises:
        QuantizeValueError: the buffer's size does not match the header.

    Example::

        q = mpx.quantize.quantize(grad, bits=4, bucket_size=512)
        print(q.nbytes / (grad.numel() * 4))      # about 0.13 at 4 bits
        grad2 = mpx.quantize.dequantize(q)
    """

    def __init__(
        self,
        buffer: torch.Tensor,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        bits: int,
        bucket_size: int,
        skip_incomplete_buckets: bool = False,
    ) -> None:
        self.shape = torch.Size(shape)
        self.dtype = check_dtype(dtype)
        self.bits = check_bits(bits)
        self.bucket_size = check_bucket_size(bucket_size)
        self.skip_incomplete_buckets = bool(skip_incomplete_buckets)
        self.layout = layout(
            math.prod(self.shape), dtype, bits, bucket_size, self.skip_incomplete_buckets
        )
        if not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.uint8:
            raise QuantizeTypeError(
                f"QuantizedTensor buffer must be a uint8 tensor, got "
                f"{getattr(buffer, 'dtype', type(buffer).__name__)}"
            )
        if buffer.dim() != 1 or not buffer.is_contiguous():
            raise QuantizeValueError(
                f"QuantizedTensor buffer must be 1-D and contiguous, got shape "
                f"{tuple(buffer.shape)}"
            )
        if buffer.numel() != self.layout.nbytes:
            raise QuantizeValueError(
                f"QuantizedTensor buffer has {buffer.numel()} bytes but shape "
                f"{tuple(self.shape)}, dtype {dtype}, bits={bits}, bucket_size={bucket_size}, "
                f"skip_incomplete_buckets={self.skip_incomplete_buckets} need "
                f"{self.layout.nbytes}"
            )
        if buffer.storage_offset() % 4:
            # the float views need an aligned start: copy a buffer sliced at an odd offset
            buffer = buffer.clone()
        self.buffer = buffer

    @classmethod
    def empty(
        cls,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        bits: int,
        bucket_size: int,
        skip_incomplete_buckets: bool = False,
        device: torch.device | str | None = None,
    ) -> QuantizedTensor:
        """An uninitialised quantized tensor (e.g. a receive buffer)."""
        lay = layout(
            math.prod(shape),
            check_dtype(dtype),
            check_bits(bits),
            check_bucket_size(bucket_size),
            skip_incomplete_buckets,
        )
        buffer = torch.empty(lay.nbytes, dtype=torch.uint8, device=device)
        return cls(buffer, shape, dtype, bits, bucket_size, skip_incomplete_buckets)

    @classmethod
    def from_parts(
        cls,
        values: torch.Tensor,
        mins: torch.Tensor,
        units: torch.Tensor,
        shape: tuple[int, ...] | torch.Size,
        dtype: torch.dtype,
        bits: int,
        bucket_size: int,
        tail: torch.Tensor | None = None,
    ) -> QuantizedTensor:
        """Assembles a quantized tensor from its parts, checking each against the header.

        A non-empty ``tail`` means the short last bucket is kept raw
        (``skip_incomplete_buckets``).
        """
        skip = tail is not None and tail.numel() > 0
        q = cls.empty(shape, dtype, bits, bucket_size, skip, device=values.device)
        lay = q.layout
        mdt = meta_dtype(dtype)
        expected = {
            "values": (values, torch.uint8, lay.values_bytes),
            "mins": (mins, mdt, lay.buckets),
            "units": (units, mdt, lay.buckets),
        }
        if tail is not None:
            expected["tail"] = (tail, dtype, lay.tail)
        for name, (part, want_dtype, want_numel) in expected.items():
            if part.dtype != want_dtype or part.numel() != want_numel:
                raise QuantizeValueError(
                    f"QuantizedTensor.from_parts: {name} has {part.numel()} elements of "
                    f"{part.dtype}, but shape {tuple(q.shape)}, dtype {dtype}, bits={bits}, "
                    f"bucket_size={bucket_size} need {want_numel} of {want_dtype}"
                )
        q.values.copy_(values.reshape(-1))
        q.mins.copy_(mins.reshape(-1))
        q.units.copy_(units.reshape(-1))
        if tail is not None:
            q.tail.copy_(tail.reshape(-1))
        return q

    # -- views into the buffer ------------------------------------------------

    def _view(self, start: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        size = torch.finfo(dtype).bits // 8 if dtype.is_floating_point else 1
        return self.buffer[start : start + count * size].view(dtype)

    @property
    def mins(self) -> torch.Tensor:
        """Per-bucket minimum, in :func:`meta_dtype` (NaN for a flagged bucket)."""
        return self._view(self.layout.mins_offset, self.layout.buckets, self.meta_dtype)

    @property
    def units(self) -> torch.Tensor:
        """Per-bucket step between levels, in :func:`meta_dtype` (0 for a constant bucket)."""
        return self._view(self.layout.units_offset, self.layout.buckets, self.meta_dtype)

    @property
    def tail(self) -> torch.Tensor:
        """The raw short last bucket (empty unless ``skip_incomplete_buckets``)."""
        return self._view(self.layout.tail_offset, self.layout.tail, self.dtype)

    @property
    def values(self) -> torch.Tensor:
        """The packed codes (uint8)."""
        return self.buffer[self.layout.values_offset :]

    @property
    def meta_dtype(self) -> torch.dtype:
        return meta_dtype(self.dtype)

    @property
    def device(self) -> torch.device:
        return self.buffer.device

    @property
    def nbytes(self) -> int:
        """Bytes of the whole quantized tensor (codes, metadata and raw tail)."""
        return self.layout.nbytes

    def numel(self) -> int:
        return self.layout.numel

    @property
    def num_buckets(self) -> int:
        return self.layout.buckets

    def clone(self) -> QuantizedTensor:
        return QuantizedTensor(
            self.buffer.clone(),
            self.shape,
            self.dtype,
            self.bits,
            self.bucket_size,
            self.skip_incomplete_buckets,
        )

    def __repr__(self) -> str:
        return (
            f"QuantizedTensor(shape={tuple(self.shape)}, dtype={self.dtype}, bits={self.bits}, "
            f"bucket_size={self.bucket_size}, nbytes={self.nbytes}, device={self.device})"
        )
