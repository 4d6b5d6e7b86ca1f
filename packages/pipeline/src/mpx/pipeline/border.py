"""What crosses a stage border: a tensor, or tuples, lists and dicts of tensors and plain values.

::

    ({"h": h, "mask": mask, "n": 3}, {"skip": s})        a stage's output
      |  flatten
      v
    tensors [h, mask, s]      spec (the structure, with 3 kept as is)
    flags   [True, False, True]   (does the tensor carry a gradient back?)

A border travels as a *header* (the spec and every tensor's shape, dtype and
flag, pickled into bytes) and then its tensors, one message each. Plain
values (None, bool, int, float, str, bytes) ride in the spec unchanged. A
tensor carries a gradient back iff it requires grad; in a forward run
without grad (a recomputed micro-batch's first pass) that cannot be seen, so
there every floating-point tensor does (a mask of floats then gets a zero
gradient: wasted, never wrong).

Inputs and targets are cut into micro-batches the same way: every tensor
along dim 0, plain values copied into every micro-batch.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import torch

from mpx.collectives.building_blocks import encode_header as _encode_header
from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = [
    "HEADER_BYTES",
    "MAX_TENSORS",
    "Spec",
    "carries_grad",
    "concat",
    "decode",
    "encode",
    "first_tensor",
    "flatten",
    "map_tensors",
    "split",
    "unflatten",
    "wire_dtype",
]

HEADER_BYTES = 16384
"""Room for one border's header; a receive is posted with this many bytes before the
structure is known (a header is a few dozen bytes per tensor)."""

MAX_TENSORS = 255
"""Tensors per border; the failure settling logs the sizes of this many sends per tag."""

_PLAIN = (type(None), bool, int, float, str, bytes)

Spec = Any
"""A border's structure: ``"T"`` for a tensor, ``("tuple"|"list", [specs])``,
``("dict", [(key, spec)])`` or ``("value", plain value)``."""


def flatten(obj: Any, what: str = "a stage's output") -> tuple[list[torch.Tensor], Spec]:
    """The tensors of ``obj`` in order, and its structure.

    Raises:
        PipelineTypeError: a value that cannot cross a border (names its type and place).
    """
    tensors: list[torch.Tensor] = []

    def walk(x: Any, where: str) -> Spec:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return "T"
        if type(x) in (tuple, list):
            return (type(x).__name__, [walk(v, f"{where}[{k}]") for k, v in enumerate(x)])
        if type(x) is dict:
            return ("dict", [(k, walk(v, f"{where}[{k!r}]")) for k, v in x.items()])
        if isinstance(x, _PLAIN):
            return ("value", x)
        raise PipelineTypeError(
            f"{what}{where} is a {type(x).__name__}; a stage border carries tensors, tuples, "
            "lists and dicts of them, and plain values (None, bool, int, float, str, bytes): "
            "return one of those"
        )

    spec = walk(obj, "")
    return tensors, spec


def unflatten(spec: Spec, tensors: list[torch.Tensor]) -> Any:
    """The structure :func:`flatten` took apart, with ``tensors`` in its places."""
    it = iter(tensors)

    def build(s: Spec) -> Any:
        if s == "T":
            return next(it)
        kind, body = s
        if kind == "value":
            return body
        if kind == "dict":
            return {k: build(v) for k, v in body}
        items = [build(v) for v in body]
        return tuple(items) if kind == "tuple" else items

    return build(spec)


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], obj: Any) -> Any:
    """``obj`` with ``fn`` applied to every tensor."""
    tensors, spec = flatten(obj)
    return unflatten(spec, [fn(t) for t in tensors])


def first_tensor(obj: Any, predicate: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    """The first tensor of ``obj`` for which ``predicate`` holds (None without one)."""
    if isinstance(obj, torch.Tensor):  # the common case, without a walk
        return obj if predicate(obj) else None
    tensors, _ = flatten(obj)
    return next((t for t in tensors if predicate(t)), None)


def carries_grad(t: torch.Tensor) -> bool:
    """Whether ``t``'s gradient is sent back across the border (see the module docstring)."""
    return t.requires_grad if torch.is_grad_enabled() else t.is_floating_point()


def encode(tensors: list[torch.Tensor], spec: Spec, flags: list[bool]) -> torch.Tensor:
    """The header of a border: bytes (uint8) of its spec, shapes, dtypes and flags.

    Raises:
        PipelineValueError: too many tensors, a tensor of too many dimensions, or a
            header larger than :data:`HEADER_BYTES`.
        PipelineTypeError: a dtype no operation takes.
    """
    if len(tensors) > MAX_TENSORS:
        raise PipelineValueError(
            f"a stage border carries {len(tensors)} tensors, more than {MAX_TENSORS}; "
            "stack them into fewer tensors"
        )
    rows = []
    for t in tensors:
        _check_travels(t)
        rows.append((tuple(t.shape), str(t.dtype)))
    data = pickle.dumps((spec, rows, flags), protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > HEADER_BYTES:
        raise PipelineValueError(
            f"a stage border's header takes {len(data)} bytes, more than {HEADER_BYTES}: "
            "its plain values are too large; send them as tensors"
        )
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def wire_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a tensor travels as: bool (masks) as uint8, its bytes unchanged."""
    return torch.uint8 if dtype == torch.bool else dtype


def _check_travels(t: torch.Tensor) -> None:
    """Raises unless ``t``'s dtype and rank fit a tensor header (checked once per kind)."""
    kind = (t.dtype, t.dim())
    if kind in _FITS:
        return
    try:
        _encode_header(t.shape, wire_dtype(t.dtype))
    except TypeError as exc:
        raise PipelineTypeError(f"an activation cannot cross a stage border: {exc}") from exc
    except ValueError as exc:
        raise PipelineValueError(f"an activation cannot cross a stage border: {exc}") from exc
    _FITS.add(kind)


_FITS: set[tuple[torch.dtype, int]] = set()


def decode(header: torch.Tensor) -> tuple[Spec, list[tuple[torch.Size, torch.dtype]], list[bool]]:
    """What :func:`encode` wrote: the spec, each tensor's (shape, dtype), the flags.

    ``header`` may be longer than the message: unpickling stops at its end."""
    spec, rows, flags = pickle.loads(header.numpy().data)  # our own ranks' bytes
    metas = [(torch.Size(shape), _dtype(name)) for shape, name in rows]
    return spec, metas, flags


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise PipelineTypeError(f"a border header names dtype {name!r}, unknown to this torch")
    return dtype


def split(obj: Any, chunks: int, what: str) -> list[Any]:
    """``obj`` cut into ``chunks`` micro-batches (tensors along dim 0, plain values copied).

    Raises:
        PipelineValueError: a tensor whose batch size ``chunks`` does not divide.
    """
    tensors, spec = flatten(obj, what)
    parts = []
    for t in tensors:
        if t.dim() == 0 or t.shape[0] % chunks:
            raise PipelineValueError(
                f"{what} has batch size {t.shape[0] if t.dim() else 'none'}, not divisible by "
                f"chunks={chunks}; use a batch size that is a multiple of chunks"
            )
        parts.append(t.chunk(chunks))
    return [unflatten(spec, [p[k] for p in parts]) for k in range(chunks)]


def concat(outs: list[Any]) -> Any:
    """Micro-batch outputs put back together (tensors along dim 0, plain values of the first).

    Raises:
        PipelineValueError: parts whose shapes differ beyond dim 0.
    """
    flat = [flatten(o)[0] for o in outs]
    _, spec = flatten(outs[0])
    joined = []
    for parts in zip(*flat, strict=True):
        shapes = {tuple(p.shape[1:]) for p in parts}
        if len(shapes) > 1:
            raise PipelineValueError(
                f"the micro-batches' outputs have shapes {[tuple(p.shape) for p in parts]}, "
                "which differ beyond dim 0 and cannot be put back together; pad them to one "
                "shape in the last layer, or call with chunks=1"
            )
        joined.append(torch.cat(parts))
    return unflatten(spec, joined)
