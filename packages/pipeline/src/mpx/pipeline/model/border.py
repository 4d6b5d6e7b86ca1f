"""What crosses a stage border: a tensor, or tuples, lists and dicts of tensors and plain values.

::

    ({"h": h, "mask": mask, "n": 3}, {"skip": s})        a stage's output
      |  flatten
      v
    tensors [h, mask, s]      spec (the structure, with 3 kept as is)
    flags   [True, False, True]   (does the tensor carry a gradient back?)

A border travels as one message of a :class:`mpx.collectives.Channel`
(:mod:`mpx.pipeline.runtime.transport`): its header holds every tensor's shape and
dtype, and the spec and flags as its note; then the tensors. Plain values
(None, bool, int, float, str, bytes) ride in the spec unchanged. A
tensor carries a gradient back iff it requires grad; in a forward run
without grad (a recomputed micro-batch's first pass) that cannot be seen, so
there every floating-point tensor does (a mask of floats then gets a zero
gradient: wasted, never wrong).

Inputs and targets are cut into micro-batches the same way: every tensor
along dim 0, plain values copied into every micro-batch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = [
    "Spec",
    "carries_grad",
    "concat",
    "first_tensor",
    "flatten",
    "map_tensors",
    "split",
    "unflatten",
]

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
