"""``quantize``, ``dequantize`` and ``dequantize_add``: the public kernels.

Each call picks a backend by the tensor's device (``backend="auto"``): the C++
extension for CPU tensors, the CUDA extension for CUDA tensors when it was
built, else the pure-torch :mod:`mpx.quantize.reference`. All three produce
the same bytes for nearest rounding, and for stochastic rounding with the same
seed (see :mod:`mpx.quantize.reference` for the exact formulas).

The extensions take raw pointers: this module checks every tensor (dtype,
device, contiguity, size) before handing its ``data_ptr()`` over.
"""

from __future__ import annotations

from types import ModuleType

import torch

from mpx.quantize.codec import reference
from mpx.quantize.codec.backends import _load
from mpx.quantize.codec.format import (
    QuantizedTensor,
    check_bits,
    check_bucket_size,
    check_dtype,
)
from mpx.quantize.errors import QuantizeTypeError, QuantizeValueError

__all__ = ["BACKENDS", "dequantize", "dequantize_add", "quantize"]

BACKENDS = ("auto", "cpu", "cuda", "torch")
_DTYPE_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _backend(device: torch.device, backend: str) -> tuple[str, ModuleType | None]:
    if backend not in BACKENDS:
        raise QuantizeValueError(f"backend={backend!r} must be one of {BACKENDS}")
    if backend == "torch":
        return "torch", None
    if backend == "auto":
        backend = "cuda" if device.type == "cuda" else "cpu"
        module = _load(backend) if device.type in ("cpu", "cuda") else None
        return (backend, module) if module is not None else ("torch", None)
    if device.type != backend:
        raise QuantizeValueError(
            f"backend={backend!r} cannot work on a tensor on {device}; use backend='auto'"
        )
    module = _load(backend)
    if module is None:
        raise QuantizeValueError(
            f"backend={backend!r} was not built; reinstall with MPX_QUANTIZE_CUDA=ON "
            "or use backend='auto'"
        )
    return backend, module


def _device_and_stream(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return index, int(torch.cuda.current_stream(index).cuda_stream)


def quantize(
    x: torch.Tensor,
    bits: int = 4,
    bucket_size: int = 512,
    stochastic: bool = True,
    generator: torch.Generator | None = None,
    *,
    skip_incomplete_buckets: bool = False,
    seed: int | None = None,
    backend: str = "auto",
    out: QuantizedTensor | None = None,
) -> QuantizedTensor:
    """Quantizes ``x`` to ``bits`` bits per value in buckets of ``bucket_size``.

    Args:
        x: float32, float16 or bfloat16 tensor (CPU or CUDA), any shape.
        bits: 1 to 8.
        bucket_size: values sharing one ``min`` and ``unit``, >= 1.
        stochastic: unbiased stochastic rounding; False rounds to nearest.
        generator: the seed of stochastic rounding is drawn from it (torch's
            global generator when None), so a seeded generator gives the same
            result on every backend.
        skip_incomplete_buckets: keep a short last bucket raw (CGX's option).
        seed: the stochastic-rounding seed itself, instead of drawing one.
        backend: ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"torch"`` (the reference).
        out: write into this quantized tensor (same shape, dtype, bits, bucket
            size and option, on ``x``'s device; e.g. a view of a send buffer)
            instead of allocating one: a new large buffer costs its page
            faults on every call.

    Returns:
        A :class:`QuantizedTensor` on ``x``'s device (``out`` when given).

    Raises:
        QuantizeValueError: bits outside 1-8, bucket_size < 1, unknown backend.
        QuantizeTypeError: ``x`` is not a floating tensor of a supported dtype.

    Example::

        q = quantize(grad, bits=4, bucket_size=512, stochastic=False)
        grad_hat = dequantize(q)            # |grad - grad_hat| <= unit / 2
    """
    if not isinstance(x, torch.Tensor):
        raise QuantizeTypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    dtype = check_dtype(x.dtype)
    bits = check_bits(bits)
    bucket_size = check_bucket_size(bucket_size)
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64
    ):
        raise QuantizeValueError(f"seed={seed!r} must be an integer in [0, 2**64)")
    if stochastic and seed is None:
        seed = reference.draw_seed(generator)
    if out is not None:
        _check_out(out, x, bits, bucket_size, skip_incomplete_buckets)
    name, module = _backend(x.device, backend)
    if module is None:
        q = reference.quantize(
            x,
            bits,
            bucket_size,
            stochastic,
            skip_incomplete_buckets=skip_incomplete_buckets,
            seed=seed,
        )
        if out is None:
            return q
        out.buffer.copy_(q.buffer)
        return out
    x = x.contiguous()
    q = (
        out
        if out is not None
        else QuantizedTensor.empty(
            x.shape, dtype, bits, bucket_size, skip_incomplete_buckets, device=x.device
        )
    )
    lay = q.layout
    args = (
        x.data_ptr(),
        _DTYPE_CODE[dtype],
        lay.quantized,
        bits,
        bucket_size,
        bool(stochastic),
        int(seed or 0),
        q.mins.data_ptr() if lay.buckets else 0,
        q.units.data_ptr() if lay.buckets else 0,
        q.values.data_ptr() if lay.values_bytes else 0,
    )
    if name == "cuda":
        module.quantize(*args, *_device_and_stream(x.device))
    else:
        module.quantize(*args, torch.get_num_threads())
    if lay.tail:
        q.tail.copy_(x.view(-1)[lay.quantized :])
    return q


def _check_out(
    out: QuantizedTensor, x: torch.Tensor, bits: int, bucket_size: int, skip: bool
) -> None:
    """``quantize(..., out=)``: the header must be the one quantize would make."""
    if not isinstance(out, QuantizedTensor):
        raise QuantizeTypeError(f"out must be a QuantizedTensor, got {type(out).__name__}")
    want = (tuple(x.shape), x.dtype, bits, bucket_size, skip, x.device)
    have = (
        tuple(out.shape),
        out.dtype,
        out.bits,
        out.bucket_size,
        out.skip_incomplete_buckets,
        out.buffer.device,
    )
    if want != have:
        names = ("shape", "dtype", "bits", "bucket_size", "skip_incomplete_buckets", "device")
        diffs = ", ".join(
            f"{n}={h!r} (needs {w!r})" for n, w, h in zip(names, want, have, strict=True) if w != h
        )
        raise QuantizeValueError(
            f"out does not fit this quantization: {diffs}; make it with "
            "QuantizedTensor.empty(x.shape, x.dtype, bits, bucket_size, ...) on x's device"
        )


def _decode(q: QuantizedTensor, out: torch.Tensor, accumulate: bool, backend: str) -> None:
    if not isinstance(q, QuantizedTensor):
        raise QuantizeTypeError(f"expected a QuantizedTensor, got {type(q).__name__}")
    name = "acc" if accumulate else "out"
    flat = reference.check_output(q, out, name)
    kind, module = _backend(q.device, backend)
    if module is None:
        if accumulate:
            reference.dequantize_add(q, out)
        else:
            reference.dequantize(q, out)
        return
    lay = q.layout
    if lay.quantized:
        args = (
            q.values.data_ptr(),
            q.mins.data_ptr(),
            q.units.data_ptr(),
            _DTYPE_CODE[q.dtype],
            lay.quantized,
            q.bits,
            q.bucket_size,
            flat.data_ptr(),
            _DTYPE_CODE[out.dtype],
            accumulate,
        )
        if kind == "cuda":
            module.dequantize(*args, *_device_and_stream(q.device))
        else:
            module.dequantize(*args, torch.get_num_threads())
    if lay.tail:
        tail = flat[lay.quantized :]
        if accumulate:
            tail.copy_(tail.to(torch.float32) + q.tail.to(torch.float32))
        else:
            tail.copy_(q.tail)


def dequantize(
    q: QuantizedTensor, out: torch.Tensor | None = None, *, backend: str = "auto"
) -> torch.Tensor:
    """Decodes ``q`` (``min + code * unit`` per value).

    Args:
        q: a quantized tensor.
        out: a contiguous float tensor with ``q.numel()`` elements on ``q``'s
            device, any float dtype; a new tensor of ``q.shape`` and ``q.dtype``
            when None.

    Returns:
        ``out``, or the new tensor.
    """
    if out is None:
        if not isinstance(q, QuantizedTensor):
            raise QuantizeTypeError(f"dequantize expects a QuantizedTensor, got {type(q).__name__}")
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _decode(q, out, False, backend)
    return out


def dequantize_add(q: QuantizedTensor, acc: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``acc += dequantize(q)`` in one pass: the sum is formed in float32 and rounded once.

    This is the reduce step of the compressed allreduce: a rank adds its
    peers' quantized chunks into its own full-precision chunk.
    """
    _decode(q, acc, True, backend)
    return acc
