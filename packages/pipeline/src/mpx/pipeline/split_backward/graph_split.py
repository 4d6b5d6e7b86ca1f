"""``I`` read from the autograd graph: a chunk's forward runs as it is, and its matrix
products' weight gradients are left for ``W`` without intercepting a single call.

:mod:`mpx.pipeline.split_backward.capture` finds a chunk's weight calls while its forward
runs, through a :class:`torch.overrides.TorchFunctionMode`: a Python handler
for every torch call and a custom autograd function for every product. On
small layers that is what the split costs: on a GPT-2 block of width 128 the
handler and the products' Python backward add about a fifth to a forward and
a backward, more than ZB-H1 can gain at two stages (10 %). Most weights are
used by matrix products only, and those are visible in the graph the forward
already built, so :class:`ChunkSplit` first reads it there:

1. After the forward, ``I`` walks the graph from the chunk's outputs. A weight
   (a leaf of 2+ dimensions among the chunk's weights) whose every use is the
   second operand of ``addmm`` or ``mm`` (``torch.addmm(bias, x, W)`` as in
   GPT-2's ``Conv1D``, ``x @ W``), directly or through a transpose of its own
   (``W.t()`` in ``F.linear``, ``W.T``), is left for ``W``: its record is the product's saved input,
   and the gradient of the product's output, which the backward hands over as
   one of its ``inputs`` (a :class:`torch.autograd.graph.GradientEdge`: the
   engine computes it and stops there, whether or not the product runs on).
2. ``I`` is one ``torch.autograd.backward`` whose ``inputs`` are every other
   leaf the graph reaches (the chunk's input, norms' scales, biases, embeddings)
   and those edges: the engine skips the deferred weights' products, and the
   graph is freed as it runs. ``W`` is :func:`mpx.pipeline.split_backward.deferred.weight_grads`
   as before.
3. A weight used any other way keeps its gradient in ``I`` (exact, not
   deferred). Where that use is an operation the capture mode would have
   deferred (a convolution, an LSTM, a compiled graph, a cast under autocast:
   anything but a view or a lookup of the weight), the chunk's later forwards run
   under the capture mode (:mod:`mpx.pipeline.split_backward.capture`) instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from mpx.pipeline.split_backward.capture import capturing
from mpx.pipeline.split_backward.deferred import Records

__all__ = ["ChunkSplit"]

# The products whose weight operand's gradient W computes: the node's type, the
# slot of that operand among its next functions, and the saved input it needs.
_PRODUCTS = {"AddmmBackward0": (2, "_saved_mat1"), "MmBackward0": (1, "_saved_self")}
# Uses of a weight the capture mode would also leave to I: a view of the weight
# alone or a lookup with integer indices. A weight used so is not deferred, and
# the graph path stays; any other use makes the chunk capture.
_VIEWS_AND_LOOKUPS = frozenset(
    {
        "AsStridedBackward0",
        "EmbeddingBackward0",
        "ExpandBackward0",
        "IndexBackward0",
        "PermuteBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SplitBackward0",
        "SplitWithSizesBackward0",
        "TBackward0",
        "TransposeBackward0",
        "UnbindBackward0",
        "UnsafeViewBackward0",
        "ViewBackward0",
    }
)

_Node = Any  # torch.autograd.graph.Node; its subclasses are made at run time


class _Plan:
    """What the walk found: the gradient edges of the leaves ``I`` fills, the products
    whose weight waits for ``W``, and whether a weight was used in a way only the
    capture mode defers."""

    __slots__ = ("captures", "leaves", "products")

    def __init__(self) -> None:
        self.leaves: list[GradientEdge] = []
        self.products: list[tuple[_Node, torch.Tensor, torch.Tensor, bool]] = []
        self.captures = False


# A leaf's node in the graph (AccumulateGrad), found through the public API; the
# walk compares each node's class with it (cheaper than its name, per node).
_ACCUMULATE = type(get_gradient_edge(torch.zeros((), requires_grad=True)).node)


def _consumers(roots: list[_Node]) -> tuple[dict[_Node, list[tuple[_Node, int]]], list[_Node]]:
    """Every node reached from ``roots``, with the (node, slot) pairs that use it, and
    the leaves' nodes among them (one walk: ``I`` runs it per micro-batch)."""
    used: dict[_Node, list[tuple[_Node, int]]] = {root: [] for root in roots}
    leaves = [root for root in roots if type(root) is _ACCUMULATE]
    stack = list(used)
    while stack:
        node = stack.pop()
        for slot, (nxt, _) in enumerate(node.next_functions):
            if nxt is None:
                continue
            users = used.get(nxt)
            if users is None:
                used[nxt] = [(node, slot)]
                stack.append(nxt)
                if type(nxt) is _ACCUMULATE:
                    leaves.append(nxt)
            else:
                users.append((node, slot))
    return used, leaves


def _transposes(node: _Node) -> bool:
    """Whether ``node`` is the backward of a transpose of a 2-D weight: ``W.t()``
    (``F.linear``), ``W.T`` (a permute), ``W.transpose(0, 1)``, ``W.mT``."""
    kind = type(node).__name__
    if kind == "TBackward0":
        return True
    if kind == "TransposeBackward0":
        return bool(node._saved_dim0 % 2 != node._saved_dim1 % 2)
    if kind == "PermuteBackward0":
        return [d % 2 for d in node._saved_dims] == [1, 0]
    return False


def _product_of(
    node: _Node, slot: int, used: dict[_Node, list[tuple[_Node, int]]]
) -> tuple[_Node, bool] | None:
    """The product taking a weight at ``(node, slot)`` and whether it takes it as
    ``W.t()`` (``F.linear``), or None where that use is not such a product."""
    transposed = True  # out = x @ W
    if _transposes(node):
        users = used[node]
        if len(users) != 1:
            return None
        (node, slot), transposed = users[0], False  # out = x @ W.t()
    found = _PRODUCTS.get(type(node).__name__)
    if found is None or found[0] != slot:
        return None
    if type(node).__name__ == "AddmmBackward0" and node._saved_alpha != 1:
        return None  # W's product would need the scale: the capture mode's case
    return node, transposed


def _plan(roots: list[_Node], weights: set[int]) -> _Plan:
    used, nodes = _consumers(roots)
    plan = _Plan()
    for node in nodes:
        leaf: torch.Tensor = node.variable
        products: list[tuple[_Node, bool]] | None = None
        if id(leaf) in weights and leaf.is_floating_point():
            users = used[node]
            found = [_product_of(user, slot, used) for user, slot in users]
            if found and all(f is not None for f in found):
                products = found  # type: ignore[assignment]
            elif any(type(user).__name__ not in _VIEWS_AND_LOOKUPS for user, _ in users):
                plan.captures = True
        inputs = [getattr(p, _PRODUCTS[type(p).__name__][1]) for p, _ in products or []]
        if products is None or not all(
            isinstance(x, torch.Tensor) and x.layout == torch.strided for x in inputs
        ):
            # I computes it, every use at once. Its edge from the node the walk
            # found: get_gradient_edge(leaf) finds that node again through a view
            # of the leaf (5 us a leaf; two GPT-2 blocks have 17 such leaves).
            plan.leaves.append(GradientEdge(node, 0))
            continue
        for (product, transposed), x in zip(products, inputs, strict=True):
            plan.products.append((product, x, leaf, transposed))
    return plan


class ChunkSplit:
    """How one chunk's backward is split: from its graph, or (once the graph showed a
    weight only the capture mode defers) with :func:`mpx.pipeline.split_backward.capture.capturing`.

    Example::

        split = ChunkSplit()
        records = Records()
        with split.forward(list(chunk.parameters()), records):
            out = chunk(x)
        split.input_backward([out], [grad], records)  # I
        weight_grads(records)                            # W
    """

    def __init__(self) -> None:
        self.captures = False

    @contextlib.contextmanager
    def forward(self, weights: Sequence[torch.Tensor], records: Records) -> Iterator[None]:
        """The chunk's forward: as it is, or under the capture mode. ``weights``: the
        tensors whose products may wait for ``W`` (the chunk's parameters, or what a
        stale schedule runs instead of them)."""
        records.weights = list(weights)
        if not self.captures:
            yield
            return
        records.captured = True
        with capturing(weights, records):
            yield

    def input_backward(
        self,
        tensors: list[torch.Tensor],
        grads: list[torch.Tensor],
        records: Records,
    ) -> None:
        """``I``: every gradient of the graph behind ``tensors`` but what ``records``
        leaves for ``W``; the graph is freed."""
        if records.captured:
            torch.autograd.backward(tensors, grads)  # the calls recorded themselves
            return
        ids = {
            id(w) for w in records.weights if w.dim() >= 2 and w.requires_grad and w.grad_fn is None
        }
        plan = _plan([get_gradient_edge(t).node for t in tensors], ids)
        if plan.captures:
            self.captures = True
        if not plan.products:
            torch.autograd.backward(tensors, grads)
            return
        edges: list[GradientEdge] = []
        for product, x, weight, transposed in plan.products:
            product.register_prehook(_recorder(records, x, weight, transposed))
            edges.append(GradientEdge(product, 0))
        # Leaves as their gradient edges: one list of one kind (the engine takes both).
        torch.autograd.backward(tensors, grads, inputs=[*plan.leaves, *edges])


def _recorder(records: Records, x: torch.Tensor, weight: torch.Tensor, transposed: bool) -> Any:
    def record(grads: tuple[torch.Tensor | None, ...]) -> None:
        grad = grads[0]
        if grad is not None:  # None: the product's output got no gradient at all
            records.add((x, grad, weight, None, transposed))

    return record
