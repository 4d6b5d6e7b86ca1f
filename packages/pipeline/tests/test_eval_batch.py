"""Evaluation takes any batch size: ``pipe(x)`` equals the sequential model's output.

``chunks`` micro-batches, the last ones shorter where ``chunks`` does not divide
the batch, one per sample where the batch is smaller; every rank but the first
may pass None. Training (``step``) still needs a batch that ``chunks`` divides
and says so. Size-agnostic: one block of layers per virtual stage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.pipeline import Pipeline, PipelineError
from mpx.pipeline.schedules.table import stages_per_rank

pytestmark = pytest.mark.mpi

D, OUT, CHUNKS = 5, 3, 4


def make_model(stages: int) -> nn.Sequential:
    torch.manual_seed(99)
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(D, D), nn.Tanh()]
    layers.append(nn.Linear(D, OUT))
    return nn.Sequential(*layers).double()


def balance_of(stages: int) -> list[int]:
    return [2] * (stages - 1) + [3]


def inputs(batch: int) -> torch.Tensor:
    return torch.randn(
        batch, D, generator=torch.Generator().manual_seed(batch), dtype=torch.float64
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "zbv", "async"])
def test_any_batch_size_gives_the_sequential_output(schedule: str) -> None:
    ranks = world().size
    stages = ranks * stages_per_rank(schedule, None)
    model = make_model(stages)
    ref = make_model(stages).eval()
    # interleaved_1f1b runs rounds of one micro-batch per rank: chunks a multiple of the ranks.
    chunks = 2 * ranks if schedule == "interleaved_1f1b" else CHUNKS
    pipe = Pipeline(model, balance_of(stages), chunks=chunks, schedule=schedule).eval()
    for batch in (1, chunks - 1, chunks, chunks + 1, 2 * chunks + 3, 1):
        x = inputs(batch)
        # Only the first stage reads the inputs: the others may pass None.
        out = pipe(x if pipe.first else None)
        if pipe.last:
            assert out is not None
            assert out.shape == (batch, OUT)
            torch.testing.assert_close(out, ref(x).detach(), rtol=0, atol=1e-12)
        else:
            assert out is None


def test_evaluation_between_training_steps_keeps_training_exact() -> None:
    """An odd-sized evaluation in between leaves the next step as a fresh pipeline's."""
    ranks = world().size
    model, ref = make_model(ranks), make_model(ranks)
    pipe = Pipeline(model, balance_of(ranks), chunks=CHUNKS, schedule="1f1b")
    x, y = inputs(2 * CHUNKS), torch.arange(2 * CHUNKS) % OUT
    pipe(inputs(CHUNKS + 1))
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    parts = zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True)
    ref_loss = torch.stack([nn.functional.cross_entropy(ref(xj), yj) for xj, yj in parts]).mean()
    assert abs(loss - ref_loss.item()) < 1e-12


def test_training_still_needs_a_batch_that_chunks_divides() -> None:
    ranks = world().size
    pipe = Pipeline(make_model(ranks), balance_of(ranks), chunks=CHUNKS, schedule="1f1b")
    x, y = inputs(CHUNKS + 1), torch.zeros(CHUNKS + 1, dtype=torch.int64)
    with pytest.raises(PipelineError, match=r"batch size 5, not divisible by chunks=4"):
        pipe.step(x, y, nn.functional.cross_entropy)


def test_bad_evaluation_inputs_on_the_first_stage_raise_on_every_stage() -> None:
    ranks = world().size
    pipe = Pipeline(make_model(ranks), balance_of(ranks), chunks=CHUNKS).eval()
    with pytest.raises(PipelineError, match=r"on rank 0: .*batch size 0"):
        pipe(torch.zeros(0, D, dtype=torch.float64))
    out = pipe(inputs(3))  # the next call works
    assert (out is not None) == pipe.last
