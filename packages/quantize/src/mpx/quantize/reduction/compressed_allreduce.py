"""The compressed allreduce: scatter-reduce-allgather with quantized chunks.

With p ranks a flat tensor is cut into p chunks; rank r owns chunk r::

    rank r:   [ chunk 0 | chunk 1 | ... | chunk r (own) | ... | chunk p-1 ]
                 |  quantize every chunk but its own (stochastic, b bits)
    alltoall  ---+--> owner of chunk j receives the p-1 quantized copies of it
    reduce        acc = own chunk (float32) + sum_j dequantize(q_j)   (dequantize_add)
                  acc /= p for "avg"; q = quantize(acc)
                  the owner keeps dequantize(q) too, not acc
    allgather     every rank decodes the p quantized reduced chunks

Each element is quantized twice (once by its sender, once by its owner), so the
error per element is at most  sum over senders of unit_j/2 + unit_owner/2  with
nearest rounding (units instead of half units with stochastic rounding), and
every rank ends with the same bits. A rank sends 2 (p-1) chunks of about
``n/p * bits/8`` bytes plus metadata, against ``2 (p-1)/p * n * 4`` bytes for a
float32 ring allreduce: about 32/bits times less.

Tensors below ``config.min_compressed`` elements, dtypes other than float32,
float16 and bfloat16, and ``bits=32`` go through ``mpx.collectives.allreduce``
unchanged, on the implementation ``config.impl`` names (never the one
``MPX_COLLECTIVES_IMPL`` selects: that may be this allreduce itself). CUDA
tensors are quantized on the GPU; only the compressed bytes cross to the
host for MPI.

``CompressionConfig(when="auto")`` compresses a buffer only where the
compressed path was measured clearly faster than the plain one on this job's
link (:mod:`mpx.quantize.compression_choice`); else it goes the plain way.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from mpx.quantize.codec import (
    FLOAT_DTYPES,
    QuantizedTensor,
    dequantize,
    dequantize_add,
    layout,
    quantize,
)
from mpx.quantize.errors import QuantizeTypeError, QuantizeValueError
from mpx.quantize.reduction.compression_choice import choose
from mpx.quantize.reduction.config import CompressionConfig
from mpx.quantize.reduction.state import QuantizeState

if TYPE_CHECKING:
    from mpx.collectives import CommLike, Communicator

__all__ = ["allreduce", "allreduce_tensors", "chunk_bounds"]

_OPS = ("sum", "avg")
# One default state per communicator (generator and residuals of plain calls).
_DEFAULT_STATES: dict[int, QuantizeState] = {}


def chunk_bounds(numel: int, size: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's chunk: ``ceil(numel / size)`` elements, the last short."""
    step = -(-numel // size) if size else 0
    return [(min(numel, j * step), min(numel, (j + 1) * step)) for j in range(size)]


def _default_state(comm: Communicator, config: CompressionConfig) -> QuantizeState:
    state = _DEFAULT_STATES.get(id(comm))
    if state is None or state.comm is not comm:
        state = _DEFAULT_STATES[id(comm)] = QuantizeState(config, comm)
    return state


def _check_op(op: str) -> None:
    if op not in _OPS:
        raise QuantizeValueError(
            f"op={op!r} is not supported by the compressed allreduce: use {_OPS}"
        )


def _plain(
    flat: torch.Tensor, comm: Communicator, op: str, state: QuantizeState, impl: str
) -> None:
    from mpx.collectives import allreduce as mpx_allreduce

    wire = 2 * (comm.size - 1) * flat.numel() * flat.element_size() // comm.size
    state.bytes_sent += wire
    state.bytes_uncompressed += wire
    if flat.device.type == "cuda":
        host = flat.cpu()
        mpx_allreduce(host, op, comm=comm, impl=impl)
        flat.copy_(host)
    else:
        mpx_allreduce(flat, op, comm=comm, impl=impl)


def _compressed(
    flat: torch.Tensor,
    comm: Communicator,
    config: CompressionConfig,
    op: str,
    state: QuantizeState,
    key: Hashable,
) -> None:
    """Scatter-reduce-allgather of the 1-D contiguous ``flat``, in place (see the module doc)."""
    from mpx.collectives import allgather, alltoall

    p, r = comm.size, comm.rank
    n, dtype, device = flat.numel(), flat.dtype, flat.device
    bits, bs, skip = config.bits, config.bucket_size, config.skip_incomplete_buckets
    # Ranks that quantize differently exchange buffers of different layouts:
    # values up to 1e35, ranks diverging. Compared once per configuration
    # (MPX_CHECK), before any data moves; the error names the field.
    comm.check_same("quantized allreduce", _agreed(config, flat, op))
    bounds = chunk_bounds(n, p)
    lays = [layout(e - s, dtype, bits, bs, skip) for s, e in bounds]
    # rows of the exchange buffers start 8-byte aligned: the metadata views need it
    block = -(-max(lay.nbytes for lay in lays) // 8) * 8
    gen = state.generator
    residual = None
    if config.error_feedback:
        residual = state.residual(key, flat)
        flat.copy_((flat.to(torch.float32) + residual).to(dtype))

    def encode(x: torch.Tensor, row: torch.Tensor, j: int) -> QuantizedTensor:
        """Quantizes chunk ``j``'s values ``x`` into the host buffer ``row``."""
        if device.type != "cpu":  # quantized on the device, then copied to the host
            q = quantize(x, bits, bs, config.stochastic, gen, skip_incomplete_buckets=skip)
            row[: q.nbytes].copy_(q.buffer)
            return q
        # On the CPU straight into the row: no buffer to allocate, nothing to copy.
        s, e = bounds[j]
        target = QuantizedTensor(row[: lays[j].nbytes], (e - s,), dtype, bits, bs, skip)
        return quantize(
            x, bits, bs, config.stochastic, gen, skip_incomplete_buckets=skip, out=target
        )

    def decode_view(buf: torch.Tensor, j: int) -> QuantizedTensor:
        s, e = bounds[j]
        return QuantizedTensor(buf[: lays[j].nbytes].to(device), (e - s,), dtype, bits, bs, skip)

    # 1. quantize the chunks the peers own, exchange them
    send = torch.zeros(p, block, dtype=torch.uint8)
    for j, (s, e) in enumerate(bounds):
        if j == r:
            continue
        q = encode(flat[s:e], send[j], j)
        if residual is not None:
            residual[s:e] = flat[s:e].to(torch.float32) - dequantize(
                q, out=torch.empty(e - s, dtype=torch.float32, device=device)
            )
    received = alltoall(send, comm=comm, impl=config.impl("alltoall"))

    # 2. the owner reduces its chunk in float32 and re-quantizes the result
    s, e = bounds[r]
    acc = flat[s:e].to(torch.float32, copy=True)
    for j in range(p):
        if j != r:
            dequantize_add(decode_view(received[j], r), acc)
    if op == "avg":
        acc.div_(p)
    mine = torch.zeros(block, dtype=torch.uint8)
    encode(acc.to(dtype), mine, r)

    # 3. everyone (the owner included) decodes every reduced chunk
    gathered = allgather(mine, comm=comm, impl=config.impl("allgather"))
    for j, (s2, e2) in enumerate(bounds):
        dequantize(decode_view(gathered[j], j), out=flat[s2:e2])
    if residual is not None:
        # the owner's re-quantization error, in the units of a rank's contribution
        residual[s:e] = (acc - flat[s:e].to(torch.float32)) * (p if op == "avg" else 1)
    state.bytes_sent += 2 * (p - 1) * block
    state.bytes_uncompressed += 2 * (p - 1) * n * flat.element_size() // p


def _agreed(config: CompressionConfig, flat: torch.Tensor, op: str) -> dict[str, Hashable]:
    """What every rank's compressed allreduce (or its measurement) must agree on."""
    return {
        "bits": config.bits,
        "bucket_size": config.bucket_size,
        "skip_incomplete_buckets": config.skip_incomplete_buckets,
        "stochastic": config.stochastic,
        "dtype": str(flat.dtype).replace("torch.", ""),
        "elements": flat.numel(),
        "op": op,
        "when": config.when,
    }


def _compressible(
    flat: torch.Tensor,
    comm: Communicator,
    config: CompressionConfig,
    op: str,
    state: QuantizeState,
    key: Hashable,
) -> None:
    """``flat`` compressed, or with ``when="auto"`` the path measured faster for its size."""
    if config.when == "auto":
        impl = config.impl("allreduce")
        chosen = choose(
            flat,
            comm,
            config,
            op,
            state,
            _agreed(config, flat, op),
            plain=lambda x, scratch: _plain(x, comm, op, scratch, impl),
            compressed=lambda x, scratch: _compressed(
                x, comm, scratch.config, op, scratch, "scratch"
            ),
        )
        if not chosen.compressed:
            _plain(flat, comm, op, state, impl)
            return
    _compressed(flat, comm, config, op, state, key)


def allreduce(
    t: torch.Tensor,
    comm: CommLike | None = None,
    bits: int = 4,
    bucket_size: int = 512,
    op: str = "sum",
    *,
    config: CompressionConfig | None = None,
    state: QuantizeState | None = None,
    key: Hashable | None = None,
) -> torch.Tensor:
    """Allreduces ``t`` in place with quantized communication; every rank ends bit-identical.

    Args:
        t: a float32, float16 or bfloat16 tensor (CPU or CUDA), any shape.
            Other dtypes are reduced uncompressed.
        comm: an mpx communicator (default: ``state.comm`` or ``mpx.collectives.world()``).
        bits: bits per value when no ``config`` is given.
        bucket_size: values per bucket when no ``config`` is given.
        op: ``"sum"`` or ``"avg"``.
        config: the full settings; overrides ``bits`` and ``bucket_size``.
            ``t`` is compressed when it has at least ``config.min_compressed``
            elements (layer filtering needs names: :func:`allreduce_tensors`).
        state: generator and error-feedback residuals kept across calls
            (a per-communicator default when None).
        key: names ``t`` for error feedback (default: its storage address and size).

    Returns:
        ``t``, holding the (approximate) reduction.

    Example::

        flat = torch.cat([p.grad.flatten() for p in model.parameters()])
        allreduce(flat, bits=4, op="avg")
        allreduce(flat, config=CompressionConfig.from_env(), op="avg")
    """
    _check_op(op)
    if not isinstance(t, torch.Tensor):
        raise QuantizeTypeError(f"allreduce expects a torch.Tensor, got {type(t).__name__}")
    if config is None:
        config = (
            state.config.with_(bits=bits, bucket_size=bucket_size)
            if state is not None
            else CompressionConfig(bits=bits, bucket_size=bucket_size)
        )
    comm = _communicator(comm, state)
    if state is None:
        state = _default_state(comm, config)
    if comm.size == 1 or t.numel() == 0:
        return t  # the sum (and the mean) over one rank is the tensor itself
    work = t if t.is_contiguous() else t.contiguous()
    flat = work.view(-1)
    if t.dtype in FLOAT_DTYPES and config.compresses(t.numel()):
        _compressible(flat, comm, config, op, state, key if key is not None else _key(t))
    else:
        _plain(flat, comm, op, state, config.impl("allreduce"))
    if work is not t:
        t.copy_(work)
    return t


def _communicator(comm: CommLike | None, state: QuantizeState | None) -> Communicator:
    """``comm`` (an mpx or mpi4py communicator), else the state's, else the world."""
    from mpx.collectives import as_communicator

    if comm is None and state is not None:
        return state.comm
    return as_communicator(comm)


def _key(t: torch.Tensor) -> Hashable:
    return ("tensor", t.data_ptr(), t.numel(), t.dtype)


def allreduce_tensors(
    tensors: Sequence[torch.Tensor],
    comm: CommLike | None = None,
    config: CompressionConfig | None = None,
    op: str = "sum",
    *,
    names: Sequence[str | None] | None = None,
    state: QuantizeState | None = None,
) -> list[torch.Tensor]:
    """Allreduces a list of tensors in place: layer filtering, then fusion buffers.

    A tensor is compressed when ``config.compresses(numel, name, dim)``: big
    enough, more than one dimension, and its name matching no exclude pattern
    (``config.exclude`` and :func:`exclude_layer`). Tensors of one kind and
    dtype are fused into flat buffers of at most ``config.fusion_buffer_mb``
    (a bigger tensor travels alone), so many small tensors cost one call::

        [w1 (compressed)] [b1 (1-D)] [w2 (compressed)] [bn.w (excluded)]
          fused compressed buffer: w1 | w2        fused plain buffer: b1 | bn.w

    Args:
        tensors: float tensors on one device.
        comm, op: as :func:`allreduce`.
        config: default ``state.config``, else :meth:`CompressionConfig.from_env`.
        names: one name (or None) per tensor, e.g. parameter names.
        state: generator, residuals, counters (default: per communicator).

    Returns:
        ``tensors``, reduced.

    Example::

        grads = [p.grad for p in model.parameters()]
        names = [n for n, _ in model.named_parameters()]
        allreduce_tensors(grads, config=CompressionConfig(bits=4), op="avg", names=names)
    """
    _check_op(op)
    tensors = list(tensors)
    if names is not None and len(names) != len(tensors):
        raise QuantizeValueError(f"names has {len(names)} entries for {len(tensors)} tensors")
    if config is None:
        config = state.config if state is not None else CompressionConfig.from_env()
    comm = _communicator(comm, state)
    if state is None:
        state = _default_state(comm, config)
    if comm.size == 1:
        return tensors
    # group by (compressed?, dtype, device), fuse greedily up to the fusion size
    groups: dict[tuple[bool, torch.dtype, torch.device], list[list[int]]] = {}
    sizes: dict[int, int] = {}
    limit = config.fusion_buffer_bytes
    for i, t in enumerate(tensors):
        name = names[i] if names is not None else None
        packed = t.dtype in FLOAT_DTYPES and config.compresses(t.numel(), name, t.dim())
        buffers = groups.setdefault((packed, t.dtype, t.device), [])
        nbytes = t.numel() * t.element_size()
        if buffers and sizes[id(buffers[-1])] + nbytes <= limit:
            buffers[-1].append(i)
            sizes[id(buffers[-1])] += nbytes
        else:
            buffers.append([i])
            sizes[id(buffers[-1])] = nbytes
    for (packed, _, _), buffers in groups.items():
        for members in buffers:
            if len(members) == 1 and tensors[members[0]].is_contiguous():
                flat = tensors[members[0]].view(-1)
            else:
                flat = torch.cat([tensors[i].reshape(-1) for i in members])
            if packed:
                key = ("fused", *(names[i] if names is not None else i for i in members))
                _compressible(flat, comm, config, op, state, key)
            else:
                _plain(flat, comm, op, state, config.impl("allreduce"))
            if len(members) > 1 or not tensors[members[0]].is_contiguous():
                offset = 0
                for i in members:
                    n = tensors[i].numel()
                    tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
                    offset += n
    return tensors
