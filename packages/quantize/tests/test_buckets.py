"""BucketMatcher: a flat DDP bucket mapped back to register_model's layers by their sizes."""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Iterator

import pytest

from mpx.quantize.buckets import BucketMatcher, Segments
from mpx.quantize.reduction.config import CompressionConfig, exclude_layer, register_model, registry

# CGX's README model shape: conv/linear layers with biases, a batch norm.
LAYERS = [
    ("fc1.weight", 2048),
    ("fc1.bias", 64),
    ("bn.weight", 64),
    ("bn.bias", 64),
    ("fc2.weight", 6144),
    ("fc2.bias", 96),
    ("head.weight", 768),
    ("head.bias", 8),
]
CONFIG = CompressionConfig(bits=4)


@pytest.fixture(autouse=True)
def clean_registry() -> Iterator[None]:
    registry.clear()
    yield
    registry.clear()


def _quantized_elements(segments: Segments) -> list[bool]:
    return [q for n, q in segments for _ in range(n)]


def _layouts(run: list[tuple[str, int]]) -> Iterator[list[tuple[str, int]]]:
    """Every order DDP may give a run: modules forward or reversed, each one permuted."""
    modules = [list(g) for _, g in itertools.groupby(run, key=lambda p: p[0].rpartition(".")[0])]
    for blocks in (modules, modules[::-1]):
        for orders in itertools.product(*(itertools.permutations(b) for b in blocks)):
            yield [p for order in orders for p in order]


def test_excluded_layers_are_exact_in_every_layout_ddp_may_give() -> None:
    register_model(LAYERS)
    exclude_layer("bn")
    exclude_layer("bias")
    matcher = BucketMatcher()
    for i, j in itertools.combinations(range(len(LAYERS) + 1), 2):
        run = LAYERS[i:j]
        numel = sum(n for _, n in run)
        got = _quantized_elements(matcher.segments(numel, CONFIG))
        assert len(got) == numel
        for layout in _layouts(run):
            position = 0
            for name, n in layout:
                if "bn" in name or "bias" in name:
                    assert not any(got[position : position + n]), (run, layout, name)
                position += n
        # and most of a run's weights are still quantized
        weights = sum(n for name, n in run if name.endswith("weight") and "bn" not in name)
        assert sum(got) >= weights // 2, run


def test_a_bucket_of_one_weight_and_its_bias_keeps_both_ends_exact() -> None:
    register_model([("fc.weight", 1000), ("fc.bias", 10)])
    exclude_layer("bias")
    # step 1 (registration order) puts the bias last, the rebuilt bucket first
    assert BucketMatcher().segments(1010, CONFIG) == ((10, False), (990, True), (10, False))


def test_small_layers_and_32_bits_are_exact() -> None:
    register_model([("a.weight", 15), ("b.weight", 400)])
    matcher = BucketMatcher()
    # below 16 elements a layer is not compressed, whatever its name (CGX's minimum)
    assert matcher.segments(415, CONFIG) == ((15, False), (385, True), (15, False))
    assert matcher.segments(400, CONFIG) == ((400, True),)
    assert matcher.segments(400, CONFIG.with_(bits=32)) == ((400, False),)


def test_a_size_no_run_of_layers_has_goes_exact_with_one_warning() -> None:
    register_model(LAYERS)
    exclude_layer("bias")
    matcher = BucketMatcher()
    with pytest.warns(RuntimeWarning, match=r"all_reduce of 12345 elements is sent exact"):
        assert matcher.segments(12345, CONFIG) == ((12345, False),)
    with warnings.catch_warnings(record=True) as seen:  # the same size again: no warning
        warnings.simplefilter("always")
        assert matcher.segments(12345, CONFIG) == ((12345, False),)
        assert matcher.segments(2048, CONFIG) == ((2048, True),)  # fc1.weight alone
    assert seen == []


def test_registration_and_exclusions_made_later_are_seen() -> None:
    matcher = BucketMatcher()
    assert not matcher.active()
    register_model([("w", 100), ("b", 20)])
    assert matcher.active()
    assert matcher.segments(120, CONFIG) == ((120, True),)
    exclude_layer("b")
    assert matcher.segments(120, CONFIG) == ((20, False), (80, True), (20, False))
