"""The reduction table: which row reduces a bucket, and what each row needs before backward.

Unit tests (no communication): ``choose`` against the rule each row declares,
and the constructor's checks (``check_choice``) as they follow from the row.
"""

from __future__ import annotations

import sys

import pytest
import torch

from mpx.dataparallel.synchronous.reduction import (
    REDUCTIONS,
    check_choice,
    choose,
    quantized_allreduce,
    shared_buckets,
)

LAYOUT = (("0.weight", torch.Size([2, 3]), 0), ("0.bias", torch.Size([2]), 6))


class _Config:
    """A stand-in for mpx.quantize.CompressionConfig: the table only asks whether it is None."""


def test_each_bucket_goes_to_the_row_its_compression_and_layout_choose() -> None:
    assert [row.name for row in REDUCTIONS] == [
        "allreduce",
        "quantized layers",
        "quantized bucket",
    ]
    assert choose(None).name == choose(None, LAYOUT).name == "allreduce"
    assert choose(_Config(), LAYOUT).name == "quantized layers"
    assert choose(_Config()).name == "quantized bucket"
    # What each row needs of mpx-quantize, and what may go with it: only the plain
    # allreduce takes impl= and reads buckets in node-shared memory.
    assert [(row.needs, row.takes_impl, row.reads_shared) for row in REDUCTIONS] == [
        ("", True, True),
        ("allreduce_tensors", False, False),
        ("allreduce", False, False),
    ]
    assert shared_buckets(None, None)
    assert shared_buckets("auto", None)
    assert shared_buckets("shm", None)
    assert not shared_buckets("ring", None)
    assert not shared_buckets(None, _Config())


def test_compression_without_mpx_quantize_names_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "mpx.quantize", None)  # import now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'mpx-dataparallel\[quantize\]'"):
        check_choice(None, _Config())
    with pytest.raises(ImportError, match="compression= needs mpx-quantize"):
        quantized_allreduce()
    check_choice(None, None)  # the plain allreduce needs no mpx-quantize


def test_impl_beside_compression_or_unknown_is_refused() -> None:
    pytest.importorskip("mpx.quantize")  # (else the missing package is named first)
    with pytest.raises(ValueError, match="pass compression= or impl=, not both"):
        check_choice("mpi", _Config())
    with pytest.raises(ValueError, match=r"impl='bogus' is not an implementation of allreduce"):
        check_choice("bogus", None)
    with pytest.raises(TypeError, match="impl must be an implementation's name, got 3"):
        check_choice(3, None)
