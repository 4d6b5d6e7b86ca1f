"""The pure-torch quantizer: the specification the C++ and CUDA kernels match.

Every step is one elementwise torch operation in float32, in the order the
kernels use, so that nearest rounding (and stochastic rounding, which draws
its noise from the same counter hash) is bit-identical across backends:

    per bucket     mn  = min(x) + 0.0            (+0.0 makes -0 and +0 agree)
                   rng = max(x) - mn
                   unit = rng / (2^b - 1)        (float16 metadata: rounded up to float16)
                   recip = 1 / unit              (0 when 1/unit overflows: constant bucket)
    per element    q = min(floor((x - mn) * recip + r), 2^b - 1)
                   r = 0.5 (nearest) or uniform(seed, element index) (stochastic)
    decode         mn + q * unit                 (then rounded to the output dtype)
    decode-add     acc + (mn + q * unit)         (in float32, one rounding to acc's dtype)

Rounding the float16 unit *up* keeps every value within the 2^b levels and a
tiny positive range from underflowing to a zero unit.

A *wide* bucket, whose finite values span more than float32's range (-3e38 and
3e38: ``max - mn`` overflows), works at half scale, where nothing overflows
(halving values that large is exact)::

    unit (rng overflows)   ((max * 0.5 - mn * 0.5) / (2^b - 1)) * 2    (inf at 1 bit: flagged)
    wide                   unit * (2^b - 1) > float32's largest value  (from the stored unit)
    encode (wide)          q = min(floor((x * 0.5 - mn * 0.5) * (1 / (unit * 0.5)) + r), 2^b - 1)
    decode (wide)          (mn * 0.5 + q * (unit * 0.5)) * 2

"Wide" is decided from the stored unit alone, so encoders and decoders of every
backend agree on it; other buckets keep the plain formulas, bit for bit.

The stochastic noise is a counter-based hash of (seed, element index), so it
does not depend on threads, tiles or the device::

    fmix32(x) = murmur3's finaliser (two multiplies, three xor-shifts, mod 2^32)
    k1 = fmix32(seed_lo ^ fmix32(seed_hi ^ index_hi ^ 0x9E3779B9))
    k2 = fmix32(k1 ^ 0x85EBCA6B)
    r  = (fmix32(fmix32(index_lo ^ k1) ^ k2) >> 8) * 2^-24        in [0, 1)

Example::

    from mpx.quantize.codec import reference
    q = reference.quantize(x, bits=4, bucket_size=512, stochastic=False)
    y = reference.dequantize(q)
"""

from __future__ import annotations

import torch

from mpx.quantize.codec.format import (
    QuantizedTensor,
    check_bits,
    check_bucket_size,
    check_dtype,
)
from mpx.quantize.errors import QuantizeTypeError, QuantizeValueError

__all__ = [
    "check_output",
    "decode_codes",
    "dequantize",
    "dequantize_add",
    "draw_seed",
    "hash_uniform",
    "pack_codes",
    "quantize",
    "unpack_codes",
]

_M32 = 0xFFFFFFFF


def draw_seed(generator: torch.Generator | None = None) -> int:
    """A 62-bit seed for stochastic rounding, drawn from ``generator`` (or torch's global one)."""
    device = generator.device if generator is not None else torch.device("cpu")
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=device).item())


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    # (x * c) mod 2^32 for x < 2^32 in int64 without overflow: split c in halves.
    low = x * (c & 0xFFFF)
    high = ((x * (c >> 16)) & 0xFFFF) << 16
    return (low + high) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def hash_uniform(
    seed: int, start: int, count: int, device: torch.device | None = None
) -> torch.Tensor:
    """Stochastic-rounding noise ``r`` (float32, [0, 1)) of elements ``start .. start+count-1``."""
    index = torch.arange(start, start + count, dtype=torch.int64, device=device)
    seed_lo = torch.tensor(seed & _M32, dtype=torch.int64, device=device)
    seed_hi = (seed >> 32) & _M32
    k1 = _fmix32(seed_lo ^ _fmix32((index >> 32) ^ seed_hi ^ 0x9E3779B9))
    k2 = _fmix32(k1 ^ 0x85EBCA6B)
    h = _fmix32(_fmix32((index & _M32) ^ k1) ^ k2)
    return (h >> 8).to(torch.float32) * 2.0**-24


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Packs integer codes (< 2^bits) 8 at a time into ``bits`` bytes, little-endian."""
    n = codes.numel()
    groups = -(-n // 8)
    padded = torch.zeros(groups * 8, dtype=torch.int64, device=codes.device)
    padded[:n] = codes.reshape(-1).to(torch.int64)
    shifts = torch.arange(bits, device=codes.device)
    # bit i of code j of a group is bit j*bits + i of the group's little-endian integer.
    bitplane = (padded.view(groups, 8, 1) >> shifts) & 1
    weights = 1 << torch.arange(8, device=codes.device)
    packed = (bitplane.reshape(groups, bits, 8) * weights).sum(-1)
    return packed.reshape(-1).to(torch.uint8)


def unpack_codes(values: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes (int64) of packed ``values``: the inverse of :func:`pack_codes`."""
    groups = values.numel() // bits
    shifts = torch.arange(8, device=values.device)
    bitplane = (values.to(torch.int64).view(groups, bits, 1) >> shifts) & 1
    weights = 1 << torch.arange(bits, device=values.device)
    codes = (bitplane.reshape(groups, 8, bits) * weights).sum(-1)
    return codes.reshape(-1)[:count]


_MAX_F32 = torch.finfo(torch.float32).max


def _is_wide(unit: torch.Tensor, levels: int) -> torch.Tensor:
    """Whether buckets of (float32) ``unit`` are wide: ``levels * unit`` past float32."""
    return unit * torch.full_like(unit, float(levels)) > _MAX_F32


def _meta(
    x: torch.Tensor, bits: int, fp16_meta: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row metadata of ``x`` [buckets, size] (float32).

    Returns (min to store, unit to store, min as float32, 1/unit, flagged, wide);
    in a wide row the min and 1/unit are those of the half scale.
    """
    levels = (1 << bits) - 1
    mn = x.amin(1) + 0.0
    mx = x.amax(1)
    rng = mx - mn
    lv = torch.full_like(rng, float(levels))
    half = ((mx * 0.5 - mn * 0.5) / lv) * 2.0  # a range past float32, at half scale
    unit = torch.where(torch.isfinite(rng), rng / lv, half)
    if fp16_meta:
        u16 = unit.to(torch.float16)
        low = u16.to(torch.float32) < unit
        u16 = torch.where(low, (u16.view(torch.int16) + 1).view(torch.float16), u16)
        unit = u16.to(torch.float32)
    recip = torch.reciprocal(unit)
    tiny = ~torch.isfinite(recip)  # unit == 0, or so small that 1/unit overflows
    zero = torch.zeros_like(unit)
    unit = torch.where(tiny, zero, unit)
    recip = torch.where(tiny, zero, recip)
    flagged = ~torch.isfinite(x).all(1) | ~torch.isfinite(unit)
    nan = torch.full_like(unit, float("nan"))
    mdt = torch.float16 if fp16_meta else torch.float32
    stored_min = torch.where(flagged, nan, mn).to(mdt)
    stored_unit = torch.where(flagged, nan, unit).to(mdt)
    wide = ~flagged & _is_wide(unit, levels)
    recip = torch.where(wide, torch.reciprocal(unit * 0.5), recip)
    mn = torch.where(wide, mn * 0.5, mn)
    recip = torch.where(flagged, zero, recip)
    mn = torch.where(flagged, zero, mn)
    return stored_min, stored_unit, mn, recip, flagged, wide


def _encode_rows(
    x: torch.Tensor,
    start: int,
    bits: int,
    fp16_meta: bool,
    seed: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes (int64, flat), stored min and unit of rows ``x`` [buckets, size] from ``start``."""
    levels = (1 << bits) - 1
    stored_min, stored_unit, mn, recip, flagged, wide = _meta(x, bits, fp16_meta)
    # a wide row's values at half scale (mn and recip already are)
    x = torch.where(wide[:, None], x * 0.5, x)
    v = (x - mn[:, None]) * recip[:, None]
    if seed is None:
        r = torch.full_like(v, 0.5)
    else:
        r = hash_uniform(seed, start, x.numel(), device=x.device).view_as(x)
    q = torch.floor(v + r).clamp(0, levels)
    q = torch.where(flagged[:, None], torch.zeros_like(q), q)
    return q.to(torch.int64).reshape(-1), stored_min, stored_unit


def quantize(
    x: torch.Tensor,
    bits: int = 4,
    bucket_size: int = 512,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
    *,
    skip_incomplete_buckets: bool = False,
    seed: int | None = None,
) -> QuantizedTensor:
    """Quantizes ``x`` in buckets with pure torch operations (see the module docstring).

    Args:
        x: float32, float16 or bfloat16 tensor, any shape.
        bits: bits per value, 1 to 8.
        bucket_size: values per bucket (min and unit each), >= 1.
        stochastic: unbiased stochastic rounding (else nearest).
        generator: draws the seed of stochastic rounding.
        skip_incomplete_buckets: keep a short last bucket raw.
        seed: the stochastic-rounding seed itself (overrides ``generator``).
    """
    if not isinstance(x, torch.Tensor):
        raise QuantizeTypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    dtype = check_dtype(x.dtype)
    bits = check_bits(bits)
    bucket_size = check_bucket_size(bucket_size)
    if stochastic and seed is None:
        seed = draw_seed(generator)
    q = QuantizedTensor.empty(
        x.shape, dtype, bits, bucket_size, skip_incomplete_buckets, device=x.device
    )
    lay = q.layout
    flat = x.reshape(-1)
    xf = flat[: lay.quantized].to(torch.float32)
    fp16_meta = dtype == torch.float16
    full = lay.quantized // bucket_size
    parts = []
    if full:
        parts.append(
            _encode_rows(
                xf[: full * bucket_size].view(full, bucket_size),
                0,
                bits,
                fp16_meta,
                seed if stochastic else None,
            )
        )
    if lay.quantized > full * bucket_size:
        start = full * bucket_size
        parts.append(
            _encode_rows(
                xf[start:].view(1, -1), start, bits, fp16_meta, seed if stochastic else None
            )
        )
    if parts:
        q.values.copy_(pack_codes(torch.cat([p[0] for p in parts]), bits))
        q.mins.copy_(torch.cat([p[1] for p in parts]))
        q.units.copy_(torch.cat([p[2] for p in parts]))
    q.tail.copy_(flat[lay.quantized :])
    return q


def decode_codes(q: QuantizedTensor) -> torch.Tensor:
    """The decoded quantized part of ``q`` in float32, flat (``q.layout.quantized`` values)."""
    lay = q.layout
    codes = unpack_codes(q.values, q.bits, lay.quantized).to(torch.float32)
    owner = torch.arange(lay.quantized, device=q.device) // q.bucket_size
    mn = q.mins.to(torch.float32)[owner]
    unit = q.units.to(torch.float32)[owner]
    wide = _is_wide(unit, (1 << q.bits) - 1)
    plain = codes * unit + mn
    scaled = (codes * (unit * 0.5) + mn * 0.5) * 2.0  # min + code * unit would overflow
    return torch.where(wide, scaled, plain)


def check_output(q: QuantizedTensor, out: torch.Tensor, name: str) -> torch.Tensor:
    """``out`` flattened, after checking it can receive ``q`` (size, dtype, contiguity)."""
    if not isinstance(out, torch.Tensor):
        raise QuantizeTypeError(f"{name} must be a torch.Tensor, got {type(out).__name__}")
    check_dtype(out.dtype)
    if out.numel() != q.numel():
        raise QuantizeValueError(
            f"{name} has {out.numel()} elements (shape {tuple(out.shape)}) but the quantized "
            f"tensor has {q.numel()} (shape {tuple(q.shape)})"
        )
    if not out.is_contiguous():
        raise QuantizeValueError(f"{name} must be contiguous; call .contiguous() first")
    if out.device != q.device:
        raise QuantizeValueError(
            f"{name} is on {out.device} but the quantized tensor on {q.device}"
        )
    return out.view(-1)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decodes ``q`` into ``out`` (or a new tensor of ``q``'s shape and dtype)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    flat = check_output(q, out, "out")
    nq = q.layout.quantized
    flat[:nq].copy_(_finite(decode_codes(q), out.dtype))
    flat[nq:].copy_(q.tail)
    return out


def _finite(decoded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Decoded values no larger than ``dtype``'s largest finite value (NaN stays NaN).

    A code times the rounded-up unit may overshoot the bucket's max a little;
    a bucket reaching float16's 65504 would decode its top code to inf.
    """
    return decoded.clamp(max=torch.finfo(dtype).max)


def dequantize_add(q: QuantizedTensor, acc: torch.Tensor) -> torch.Tensor:
    """``acc += decode(q)``, summed in float32 and rounded once to ``acc``'s dtype."""
    flat = check_output(q, acc, "acc")
    nq = q.layout.quantized
    flat[:nq].copy_(flat[:nq].to(torch.float32) + _finite(decode_codes(q), acc.dtype))
    flat[nq:].copy_(flat[nq:].to(torch.float32) + q.tail.to(torch.float32))
    return acc
