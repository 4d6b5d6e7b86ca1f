"""Which registered layers a flat gradient bucket holds: layer filtering for the ``cgx`` backend.

DDP does not tell a process group what a bucket is: ``allreduce([bucket])``
gets one flat tensor, the gradients of several parameters one after the
other. (DDP's reducer knows, but it holds its lock while it calls the group:
asking it from inside ``allreduce`` would deadlock.) CGX's
``register_model([(name, numel), ...])`` gives the layers in forward order;
:class:`BucketMatcher` maps a bucket of ``n`` elements back to them from their
sizes, by what DDP does with its buckets (measured on torch 2.13):

- a bucket holds a contiguous run of the registered parameters;
- in the first step they are in registration order; in the buckets DDP
  rebuilds after it, in the order their gradients became ready: the modules
  in reverse, but inside a module in no fixed order (``Linear``: bias, then
  weight; ``BatchNorm``: weight, then bias)::

      registered   0.weight 0.bias | 1.weight 1.bias (bn) | 3.weight 3.bias
      step 1       0.weight 0.bias 1.weight 1.bias 3.weight 3.bias
      rebuilt      3.bias 3.weight | 1.weight 1.bias 0.bias 0.weight

So the layouts a bucket of ``n`` elements may have are: every run
``layers[i:j]`` of ``n`` elements, its modules (consecutive parameters with
one name prefix) forward or reversed, each module's parameters in any order.
An element is quantized only if it is quantized in *every* one of those
layouts (``config.compresses(numel, name)``: size, excluded name parts), so
an excluded layer is exact wherever DDP put it::

    run 1.weight 1.bias (bn, 30 + 30), "bias" excluded:
      [w w w | b b b]  or  [b b b | w w w]   ->   all 60 exact
    run 3.weight 3.bias (1200 + 40): 40 exact at each end, 1160 quantized

Where several runs have that size (repeated blocks of a network), the union
is over all of them: the guarantee holds wherever the bucket lies, at the cost
of a few more exact elements. A size that no run of registered layers has (a
tensor that is not a gradient bucket, or a model whose buckets are not such
runs) goes exact as a whole, with a warning once.
"""

from __future__ import annotations

import bisect
import itertools
import warnings
from collections.abc import Sequence

from mpx.quantize.reduction import CompressionConfig, LayerRegistry, registry

__all__ = ["BucketMatcher", "Segments"]

# (elements, quantized?) runs, in bucket order; adjacent runs differ in kind.
Segments = tuple[tuple[int, bool], ...]

# A module with more parameters than this is not permuted (5! = 120 orders):
# if any of them is exact, its whole block is.
_MAX_PERMUTED = 4


def _module(name: str) -> str:
    return name.rpartition(".")[0]


def _block_exact(params: Sequence[tuple[int, bool]]) -> list[tuple[int, int]]:
    """Element ranges of a module's block that are exact in some order of its parameters."""
    total = sum(n for n, _ in params)
    if all(quantized for _, quantized in params):
        return []
    if len(params) > _MAX_PERMUTED or not any(quantized for _, quantized in params):
        return [(0, total)]
    ranges = []
    for order in itertools.permutations(params):
        offset = 0
        for n, quantized in order:
            if not quantized:
                ranges.append((offset, offset + n))
            offset += n
    return ranges


def _segments(numel: int, exact: list[tuple[int, int]]) -> Segments:
    """Segments of ``numel`` elements whose (possibly overlapping) ``exact`` ranges are exact."""
    out: list[tuple[int, bool]] = []
    position = 0
    for start, end in sorted(exact):
        if end <= position:
            continue
        if start > position:
            out.append((start - position, True))
            position = start
        if out and not out[-1][1]:
            out[-1] = (out[-1][0] + end - position, False)
        else:
            out.append((end - position, False))
        position = end
    if position < numel:
        out.append((numel - position, True))
    return tuple(out)


class BucketMatcher:
    """Segments of flat buckets by the layers of a :class:`LayerRegistry` (see the module doc).

    Every rank has the same registration and sees the same sizes, so every
    rank decides the same segments (and makes the same calls).

    Example::

        register_model([("fc.weight", 1000), ("fc.bias", 10)]); exclude_layer("bias")
        BucketMatcher().segments(1010, CompressionConfig(bits=4))
        # ((10, False), (990, True), (10, False)): the bias is first or last
    """

    def __init__(self, layers: LayerRegistry | None = None) -> None:
        self._layers = layers if layers is not None else registry
        self._key: tuple[object, ...] | None = None
        self._cache: dict[int, Segments | None] = {}
        self._warned: set[int] = set()

    def active(self) -> bool:
        """Whether layers are registered (``register_model``); else tensors are judged whole."""
        return bool(self._layers.order)

    def segments(self, numel: int, config: CompressionConfig) -> Segments:
        """The quantized and exact runs of a bucket of ``numel`` elements, in order."""
        order = [(name, n) for name, n in self._layers.order if n > 0]
        key = (tuple(order), tuple(self._layers.excluded), config)
        if key != self._key:  # registration or configuration changed
            self._key = key
            self._cache.clear()
        if numel not in self._cache:
            self._cache[numel] = self._match(numel, order, config)
        found = self._cache[numel]
        if found is None:  # no run has that size: not a bucket of this model
            if numel not in self._warned:
                self._warned.add(numel)
                self._warn(numel, len(order))
            return ((numel, False),)
        return found

    def _match(
        self, numel: int, order: list[tuple[str, int]], config: CompressionConfig
    ) -> Segments | None:
        params = [(name, n, config.compresses(n, name)) for name, n in order]
        prefix = [0]
        for _, n, _ in params:
            prefix.append(prefix[-1] + n)
        exact: list[tuple[int, int]] = []
        matched = False
        for i in range(len(params)):
            # sizes are > 0: at most one end j gives a run of exactly numel elements
            j = bisect.bisect_left(prefix, prefix[i] + numel, lo=i + 1)
            if j >= len(prefix) or prefix[j] - prefix[i] != numel:
                continue
            matched = True
            run = params[i:j]
            modules = [
                [(n, q) for _, n, q in group]
                for _, group in itertools.groupby(run, key=lambda p: _module(p[0]))
            ]
            for blocks in (modules, modules[::-1]):
                offset = 0
                for block in blocks:
                    exact += [(offset + a, offset + b) for a, b in _block_exact(block)]
                    offset += sum(n for n, _ in block)
        return _segments(numel, exact) if matched else None

    def _warn(self, numel: int, registered: int) -> None:
        warnings.warn(
            f"cgx: an all_reduce of {numel} elements is sent exact: no run of the "
            f"{registered} layers given to register_model has that size, so it cannot "
            "tell the excluded layers in it. Register the parameters of the "
            "model DDP wraps, in order: "
            "register_model([(name, p.numel()) for name, p in model.named_parameters()])",
            RuntimeWarning,
            stacklevel=4,
        )
