"""A stage's seeding and BatchNorm protection."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.pipeline import layer_seed
from mpx.pipeline.model.stage import Stage


def test_layer_seed_is_the_documented_formula() -> None:
    assert layer_seed(0, 0, 0) == 0
    assert layer_seed(3, 5, 7) == ((3 * 1_000_003 + 5) * 1_000_003 + 7) % 2**63
    assert layer_seed(0, -1, 0) >= 0


def test_masks_do_not_depend_on_the_partition_and_rng_is_restored() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5), nn.Dropout(0.5))
    x = torch.ones(4, 6)
    whole = Stage(model, 0, 3, seed=9).run(x, microbatch=2)
    before = torch.get_rng_state()
    parts = Stage(model, 1, 3, seed=9).run(Stage(model, 0, 1, seed=9).run(x, 2), 2)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(whole, parts)
    assert not torch.equal(whole, Stage(model, 0, 3, seed=9).run(x, microbatch=3))


def test_frozen_statistics_restore_batchnorm_buffers() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    stage = Stage(model, 0, 2, seed=0)
    stage.run(torch.randn(8, 3), 0)
    saved = {k: v.clone() for k, v in model[1].named_buffers()}
    with stage.frozen_statistics():
        stage.run(torch.randn(8, 3), 1)
        assert not torch.equal(model[1].get_buffer("running_mean"), saved["running_mean"])
    for k, v in model[1].named_buffers():
        assert torch.equal(v, saved[k]), k


@pytest.mark.gpu
def test_cuda_dropout_masks_are_seeded_and_cuda_rng_is_restored() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)).cuda()
    x = torch.ones(64, 32, device="cuda")
    stage = Stage(model, 0, 2, seed=4)
    before = torch.cuda.get_rng_state()
    first = stage.run(x, microbatch=3)
    again = stage.run(x, microbatch=3)  # a recomputation draws the same masks
    other = stage.run(x, microbatch=4)
    assert torch.equal(torch.cuda.get_rng_state(), before)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    # The documented seeds reproduce the masks on the device.
    expected = x
    for i, layer in enumerate(model):
        torch.cuda.manual_seed(layer_seed(4, 3, i))
        expected = layer(expected)
    assert torch.equal(first, expected)
