"""The split backward of a forward that did not capture its weight calls: the graph is kept.

A forward whose backward will be split runs under
:func:`mpx.pipeline.split_backward.capture.capturing`, which leaves ``W``'s work as small
records (:mod:`mpx.pipeline.split_backward.deferred`) for weights of any kind. A forward
that ran without it and is split all the same keeps its graph from ``I``
to ``W``, and ``W`` differentiates it (:func:`input_grad`,
:meth:`Kept.weight_grad`), at the memory cost of the whole graph until ``W``
runs.

``W`` must not walk the input-gradient chain again (in a chunk of several
layers that would be most of ``I`` over again). So ``I`` first finds, in the
graph, the nodes on the path from the outputs to the inputs that also feed a
weight by a branch of their own (a matmul node: its weight slot), and records
the gradient that reaches each of them while ``I`` runs (a node pre-hook);
``W`` starts from those nodes (``GradientEdge``) with ``inputs=`` only the
weights of their branches, which the input path does not reach again
(:func:`weight_starts`). Where it would (one weight used at two depths of a
chunk) ``W`` falls back to differentiating the outputs again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from mpx.pipeline.split_backward.deferred import accumulate

__all__ = ["Kept", "input_grad", "weight_starts"]


@dataclass
class _Start:
    """Where ``W`` starts: an output tensor (with its gradient) or a node on the input
    path (with the gradients its pre-hook saw in ``I``), and the weights (bits) below."""

    mask: int
    path: int = 0  # the weights its input-path children reach (not to be asked of it)
    tensor: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    node: Any = None
    grads: tuple[torch.Tensor | None, ...] = ()


def weight_starts(
    outputs: list[torch.Tensor], leaves: list[torch.Tensor], weights: list[torch.Tensor]
) -> list[_Start] | None:
    """The starts of ``W`` (see the module docstring), or None to fall back.

    A node on the input path (it reaches a leaf) starts ``W`` for the weights
    its other children reach; an output off that path starts it for all the
    weights below it. None when a start's input-path children reach one of
    its own weights too: from there ``W`` would run the chain again and count
    that weight's deeper use twice.
    """
    edge = torch.autograd.graph.get_gradient_edge
    targets = {edge(t).node for t in leaves}
    bit = {edge(w).node: 1 << k for k, w in enumerate(weights)}
    info: dict[Any, tuple[bool, int]] = {}  # node -> (reaches an input, weights below)
    roots = [t.grad_fn if t.grad_fn is not None else edge(t).node for t in outputs]
    stack: list[tuple[Any, bool]] = [(r, False) for r in roots if r is not None]
    while stack:  # post-order, without recursion (graphs may be deep)
        node, expanded = stack.pop()
        if node in info:
            continue
        children = [c for c, _ in node.next_functions if c is not None]
        if not expanded:
            stack.append((node, True))
            stack.extend((c, False) for c in children if c not in info)
            continue
        reach = node in targets or any(info[c][0] for c in children)
        mask = bit.get(node, 0)
        for c in children:
            mask |= info[c][1]
        info[node] = (reach, mask)
    starts: list[_Start] = []
    for t, r in zip(outputs, roots, strict=True):
        if r is not None and not info[r][0] and info[r][1]:
            starts.append(_Start(info[r][1], tensor=t))
    for node, (reach, _) in info.items():
        if not reach:
            continue
        branch = path = 0
        for c, _ in node.next_functions:
            if c is None:
                continue
            if info[c][0]:
                path |= info[c][1]
            else:
                branch |= info[c][1]
        if branch & path:
            return None
        if branch:
            starts.append(_Start(branch, path, node=node))
    return starts


def _saver(start: _Start) -> Callable[[tuple[torch.Tensor | None, ...]], None]:
    def hook(grads: tuple[torch.Tensor | None, ...]) -> None:
        start.grads = tuple(grads)

    return hook


def _from_starts(starts: list[_Start], weights: list[torch.Tensor]) -> None:
    """``W`` from the starts: in groups whose input-path children reach none of the
    group's weights (one autograd call per group, not per node: the nodes of
    parallel branches, such as a block's query, key and value, go together)."""
    groups: list[tuple[int, int, list[_Start]]] = []  # (weights, path weights, starts)
    for st in starts:
        for k, (mask, path, members) in enumerate(groups):
            if not (mask | st.mask) & (path | st.path):
                groups[k] = (mask | st.mask, path | st.path, [*members, st])
                break
        else:
            groups.append((st.mask, st.path, [st]))
    edge_type = torch.autograd.graph.GradientEdge
    for mask, _, members in groups:
        outs: list[Any] = []
        grads: list[torch.Tensor | None] = []
        for st in members:
            if st.tensor is not None:
                outs.append(st.tensor)
                grads.append(st.grad)
            for k, gr in enumerate(st.grads):
                if gr is not None:
                    outs.append(edge_type(st.node, k))
                    grads.append(gr)
        chosen = [w for k, w in enumerate(weights) if mask >> k & 1]
        if not outs:
            continue
        got = torch.autograd.grad(
            outs, inputs=chosen, grad_outputs=grads, retain_graph=True, allow_unused=True
        )
        for w, gw in zip(chosen, got, strict=True):
            if gw is not None:
                accumulate(w, gw)


@dataclass
class Kept:
    """What ``W`` differentiates after :func:`input_grad`: the starts, else the outputs."""

    owed: list[tuple[torch.Tensor, Any]] = field(default_factory=list)  # (output, its grad)
    starts: list[_Start] = field(default_factory=list)
    needs: list[torch.Tensor] = field(default_factory=list)

    def weight_grad(self, weights: list[torch.Tensor]) -> None:
        """``W``: the gradients of ``weights`` (the tensors the forward used), accumulated
        into their ``.grad``; the kept graph is let go."""
        pairs, self.owed = self.owed, []
        needs = [w for w in weights if w.requires_grad]
        if self.starts:
            _from_starts(self.starts, self.needs)
        elif pairs and needs:
            # allow_unused: a weight this micro-batch did not reach gets None.
            got: tuple[torch.Tensor | None, ...] = torch.autograd.grad(
                [t for t, _ in pairs],
                inputs=needs,
                grad_outputs=[gr for _, gr in pairs],
                allow_unused=True,
            )
            for w, gw in zip(needs, got, strict=True):
                if gw is not None:
                    accumulate(w, gw)
        self.starts, self.needs = [], []


def input_grad(
    pairs: list[tuple[torch.Tensor, Any]],
    leaves: list[torch.Tensor],
    weights: list[torch.Tensor],
    first: bool,
) -> tuple[list[torch.Tensor | None], Kept]:
    """``I`` with the graph kept: the gradients of ``leaves`` (the chunk's input tensors
    owed one) and what :meth:`Kept.weight_grad` will need.

    Args:
        pairs: (output, its gradient) to differentiate.
        weights: the tensors the forward used (``W`` differentiates them).
        first: the chunk is virtual stage 0 (its leaves are the user's inputs,
            which get their gradient as ``loss.backward()`` would give it).
    """
    kept = Kept(owed=pairs)
    grads: list[torch.Tensor | None] = [None] * len(leaves)
    if not (pairs and leaves):
        return grads, kept
    needs = [w for w in weights if w.requires_grad]
    outs = [t for t, _ in pairs]
    starts = weight_starts(outs, leaves, needs) if needs else None
    handles = []
    if starts is not None:
        kept = Kept(starts=starts, needs=needs)
        given = {id(t): gr for t, gr in pairs}
        for st in starts:
            if st.tensor is not None:
                st.grad = given.get(id(st.tensor))
            else:
                handles.append(st.node.register_prehook(_saver(st)))
    try:
        got = torch.autograd.grad(
            outs,
            inputs=leaves,
            grad_outputs=[gr for _, gr in pairs],
            retain_graph=True,
            allow_unused=True,
        )
    finally:
        for h in handles:
            h.remove()
    grads = list(got)
    if first:
        # The user's own inputs that require grad (micro-batches are views of
        # them): the gradient goes on to them as loss.backward() would send it.
        owed = [(t, gt) for t, gt in zip(leaves, grads, strict=True) if gt is not None]
        if owed:
            torch.autograd.backward([t for t, _ in owed], [gt for _, gt in owed])
    return grads, kept
