"""The operations a chunk runs on its weights, found while it runs: what ``W`` defers.

A chunk's split backward first reads its weights' products from the autograd
graph (:mod:`mpx.pipeline.split_backward.graph_split`, no cost in the forward); a chunk whose
graph shows a weight used otherwise (a convolution, an LSTM, a compiled graph)
runs its later forwards under this module's mode, which finds every such call.

While a chunk whose backward will be split runs its forward, :func:`capturing`
is a :class:`torch.overrides.TorchFunctionMode`: every torch function the
chunk calls (layers, ``torch.nn.functional``, tensor methods) passes through
it, and a call that receives one of the chunk's weights (a leaf tensor that
requires a gradient, compared by identity: the parameters, or the tensors a
stale schedule runs instead of them) runs so that its backward, in ``I``,
gives its inputs' gradients only and leaves what the weights' gradients
need in :class:`mpx.pipeline.split_backward.deferred.Records`:

- A matrix product with a weight (``F.linear``, ``torch.addmm(bias, x, W)``
  as in GPT-2's ``Conv1D``, ``x @ W``; floating point, autocast off) runs as
  :class:`mpx.pipeline.split_backward.deferred.Product`: the record is its input and its
  output's gradient, ``W`` one product, as in the Zero Bubble paper.
- A Python function of ``torch.nn.functional`` taking a weight
  (``nn.MultiheadAttention``'s ``F.multi_head_attention_forward``) runs its
  body with the mode on (its own ``__torch_function__`` check off:
  :func:`mpx.pipeline._torch_private.functional_checks_off`), so that the
  calls inside are found one by one (the attention's projections are
  products).
- Any other call with a weight of two or more dimensions (a convolution, an
  LSTM) runs on detached copies of its tensors under ``enable_grad``, as a
  small autograd function (:class:`_Local`) around that call's own graph:
  ``I`` differentiates that graph for the inputs (``retain_graph``) and
  records it with its outputs' gradients; ``W`` differentiates it for the
  weight copies and adds the result to the weights' ``.grad``. The graph
  keeps what that call saved for its backward (its inputs, mostly) and
  nothing of the rest of the chunk.

Left to ``I``, exactly as autograd computes them: weights of fewer than two
dimensions (a norm's scale, a bias on its own, a bare scale: a gradient as
cheap as one pass over the output), calls whose other tensors are not
floating point (an embedding's lookup), calls on weights alone (``W.t()``,
a slice of a position table, the attention's ``chunk`` of its packed
projection when query and key differ: what they compute is not a leaf, so
the call that takes it runs as usual), in-place calls and ``out=`` ones (the tensor
written must keep its own history), computed weights (parametrizations),
and anything under ``no_grad``. ``I`` is then a plain backward that frees
the chunk's graph as it goes.

A ``torch.compile``'d chunk: dynamo hands each call to the handler
(:func:`_untraced`, which it does not trace: a graph break per
call), so the split records as in eager mode; its forward runs about as
eager code does.
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.autograd.graph import get_gradient_edge, saved_tensors_hooks
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from mpx.pipeline._torch_private import functional_checks_off
from mpx.pipeline.split_backward.deferred import Local, Product, Records

__all__ = ["capturing"]

# The matrix products W computes as one product per record (deferred.Product).
_LINEAR = {F.linear}
_ADDMM = {torch.addmm, torch.Tensor.addmm}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}


class _Slot:
    """Where a tensor was in a call's arguments (its index in the flat list)."""

    __slots__ = ("i",)

    def __init__(self, i: int) -> None:
        self.i = i


def _cut(value: Any, flat: list[torch.Tensor]) -> Any:
    """``value`` with its tensors (and those of a list or tuple of them) put in ``flat``."""
    if isinstance(value, torch.Tensor):
        flat.append(value)
        return _Slot(len(flat) - 1)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        cut = [_cut(v, flat) for v in value]
        return cut if isinstance(value, list) else tuple(cut)
    return value


def _fill(value: Any, flat: list[torch.Tensor]) -> Any:
    if isinstance(value, _Slot):
        return flat[value.i]
    if isinstance(value, (list, tuple)) and any(isinstance(v, _Slot) for v in value):
        filled = [_fill(v, flat) for v in value]
        return filled if isinstance(value, list) else tuple(filled)
    return value


def _writes(func: Any, kwargs: dict[str, Any]) -> bool:
    """An in-place call or one with ``out=``: it must run as it is."""
    name = getattr(func, "__name__", "")
    return (
        "out" in kwargs
        or (name.endswith("_") and not name.endswith("__"))
        or name.startswith("__i")
        or name == "__setitem__"
    )


class _Call:
    """One call with weights, run by :class:`_Local`: the function, its arguments with
    ``_Slot`` for each tensor, which tensors are weights, and where ``I`` records."""

    __slots__ = ("args", "func", "is_weight", "kwargs", "list_out", "records", "weights")

    def __init__(
        self,
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        is_weight: list[bool],
        weights: list[torch.Tensor],
        records: Records,
    ) -> None:
        self.func, self.args, self.kwargs = func, args, kwargs
        self.is_weight, self.weights, self.records = is_weight, weights, records
        self.list_out = False


def _same(t: Any) -> Any:
    return t


class _Local(torch.autograd.Function):
    """A call with weights around its own graph: ``I`` gives the inputs' gradients and
    records the graph for ``W`` (see the module docstring)."""

    @staticmethod
    def forward(ctx: Any, call: _Call, *flat: torch.Tensor) -> Any:
        local = [
            t.detach().requires_grad_() if w or t.requires_grad else t
            for t, w in zip(flat, call.is_weight, strict=True)
        ]
        copies = [t for t, w in zip(local, call.is_weight, strict=True) if w]
        storages = {t.untyped_storage().data_ptr() for t in copies}
        saved: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            # What the call's graph keeps, the weights left out: counted as held for W.
            if t.untyped_storage().data_ptr() not in storages:
                saved.append(t)
            return t

        with torch.enable_grad(), saved_tensors_hooks(pack, _same):
            kwargs = {k: _fill(v, local) for k, v in call.kwargs.items()}
            out = call.func(*_fill(call.args, local), **kwargs)
        call.list_out = isinstance(out, list)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        given: list[Any] = []
        edges: list[tuple[int, Any]] = []
        for k, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                given.append(o)
                continue
            if o.requires_grad:
                edges.append((k, get_gradient_edge(o)))
            given.append(o.detach())
        plain = [
            g
            for g, o in zip(given, outs, strict=True)
            if isinstance(o, torch.Tensor) and not o.requires_grad
        ]
        if plain:
            ctx.mark_non_differentiable(*plain)
        ctx.state = (call, local, copies, edges, saved)
        return tuple(given) if isinstance(out, (tuple, list)) else given[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call, local, copies, edges, saved = ctx.state
        del ctx.state  # the call's graph lives on in the record only
        result: list[torch.Tensor | None] = [None] * len(local)
        pairs = [(e, grads[k]) for k, e in edges if grads[k] is not None]
        if pairs:
            outs, gs = [e for e, _ in pairs], [g for _, g in pairs]
            need = [
                i for i, w in enumerate(call.is_weight) if not w and ctx.needs_input_grad[1 + i]
            ]
            if need:
                got = torch.autograd.grad(
                    outs, [local[i] for i in need], gs, retain_graph=True, allow_unused=True
                )
                for i, g in zip(need, got, strict=True):
                    result[i] = g
            call.records.add_op(Local(outs, gs, copies, call.weights, saved))
        return (None, *result)


def _product(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], ids: set[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool] | None:
    """``(input, weight, bias, transposed)`` of a matrix product :class:`Product` runs,
    else None."""
    x: Any
    if func in _LINEAR:
        if len(args) < 2 or set(kwargs) - {"bias"}:
            return None
        x, w = args[0], args[1]
        b = args[2] if len(args) > 2 else kwargs.get("bias")
        transposed = False
    elif func in _ADDMM:
        if len(args) != 3 or kwargs:
            return None
        b, x, w = args
        transposed = True
        if not isinstance(x, torch.Tensor) or x.dim() != 2:
            return None
    elif func in _MATMUL:
        if len(args) != 2 or kwargs:
            return None
        x, w = args
        b, transposed = None, True
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return None
    else:
        return None
    if not (isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor)) or id(w) not in ids:
        return None
    if id(x) in ids or w.dim() != 2 or x.dtype != w.dtype or not x.is_floating_point():
        return None
    if x.layout != torch.strided or torch.is_autocast_enabled(x.device.type):
        return None
    if b is not None and not (
        isinstance(b, torch.Tensor) and id(b) in ids and b.dim() == 1 and b.dtype == w.dtype
    ):
        return None
    return x, w, b, transposed


def _holds(values: Iterable[Any], ids: set[int]) -> bool:
    """Whether ``values`` (or a list or tuple among them) hold a tensor whose id is in ``ids``."""
    for a in values:
        if isinstance(a, torch.Tensor):
            if id(a) in ids:
                return True
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor) and id(b) in ids:
                    return True
    return False


class _Capture(TorchFunctionMode):
    """Routes the calls that take a weight (see the module docstring)."""

    def __init__(self, weights: list[torch.Tensor], records: Records) -> None:
        super().__init__()
        self.weights = weights  # held: the ids below stay theirs
        self.ids = {id(w) for w in weights}
        # A call is looked at only if it takes a weight of 2+ dimensions: those
        # of fewer go to I wherever they are used (a LayerNorm's call, or a
        # weight's .shape, returns at once); a bias beside such a weight (addmm)
        # is found among the call's weights all the same.
        self.big = {id(w) for w in weights if w.dim() >= 2}
        self.records = records

    def _takes_weight(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> bool:
        big = self.big
        return _holds(args, big) or (bool(kwargs) and _holds(kwargs.values(), big))  # type: ignore[union-attr]

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        # Every torch call of the chunk comes here: the common case (no weight)
        # returns after one pass over the arguments. Under torch.compile the
        # calls go to a handler dynamo does not trace (it would guard on the
        # weights' ids, and recompile for every micro-batch).
        if torch.compiler.is_compiling():
            return _untraced()(self, func, args, kwargs or {})
        if not self._takes_weight(args, kwargs):
            return func(*args, **(kwargs or {}))
        return self._weighted(func, args, kwargs or {})

    def _weighted(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A call that takes a weight: a recorded product, a :class:`_Local`, or as it is."""
        if not torch.is_grad_enabled() or _writes(func, kwargs):
            return func(*args, **kwargs)
        product = _product(func, args, kwargs, self.ids)
        if product is not None:
            return Product.apply(*product, self.records)  # type: ignore[no-untyped-call]
        flat: list[torch.Tensor] = []
        cut_args = tuple(_cut(a, flat) for a in args)
        cut_kwargs = {k: _cut(v, flat) for k, v in kwargs.items()}
        is_weight = [id(t) in self.ids for t in flat]
        weights = [t for t, w in zip(flat, is_weight, strict=True) if w]
        if max(w.dim() for w in weights) < 2 or not any(
            not w and (t.is_floating_point() or t.is_complex())
            for t, w in zip(flat, is_weight, strict=True)
        ):
            return func(*args, **kwargs)  # cheap, or on weights alone: in I
        if isinstance(func, types.FunctionType) and func.__module__ == F.__name__:
            # A Python function of torch.nn.functional (the attention's): its body
            # runs with this mode on, so that its products record as products
            # and W does not run the attention's backward again.
            with functional_checks_off(), self:
                return func(*args, **kwargs)
        call = _Call(func, cut_args, cut_kwargs, is_weight, weights, self.records)
        out = _Local.apply(call, *flat)  # type: ignore[no-untyped-call]
        return list(out) if call.list_out else out


def _handle(mode: _Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if not mode._takes_weight(args, kwargs):
        return func(*args, **kwargs)
    return mode._weighted(func, args, kwargs)


_UNTRACED: list[Any] = []  # _handle as torch.compiler.disable makes it, once made


def _untraced() -> Any:
    """The handler as dynamo runs it under torch.compile: untraced. Made where the
    split starts once dynamo is loaded (:func:`capturing`), not at import:
    ``torch.compiler.disable`` imports dynamo (and sympy: seconds under load),
    which a process that never compiles should not pay."""
    if not _UNTRACED:
        _UNTRACED.append(torch.compiler.disable(_handle))  # type: ignore[no-untyped-call]
    return _UNTRACED[0]


@contextlib.contextmanager
def capturing(weights: Iterable[torch.Tensor], records: Records) -> Iterator[None]:
    """Within the block, the calls that take one of ``weights`` (the leaves among them
    that require a gradient) leave their weight gradients' work in ``records``.

    Example::

        records = Records()
        with capturing(model.parameters(), records):
            loss = model(x).sum()
        loss.backward()          # I: every gradient but the captured weights'
        weight_grads(records)    # W
    """
    if not _UNTRACED and "torch._dynamo" in sys.modules:
        _untraced()  # made here, in eager code: dynamo would trace the making
    leaves = [w for w in weights if w.requires_grad and w.grad_fn is None]
    if not leaves:
        yield
        return
    with _Capture(leaves, records):
        yield
