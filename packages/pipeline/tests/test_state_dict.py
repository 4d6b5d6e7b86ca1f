"""``Pipeline.state_dict()`` resumes a pipeline bitwise: numbering, async stream, gap aware.

A pipeline trained for a while, saved (weights, optimizer, the pipeline's extra
state) and loaded into a freshly built one must continue exactly as the
original does: the dropout masks follow the micro-batch numbering, the async
stream's counters decide when a partial accumulation steps, and gap aware
damps by statistics gathered over every step so far.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.pipeline import Pipeline, PipelineError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

D, OUT, CHUNKS, BATCH = 5, 3, 3, 6


def _model(stages: int) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    balance = []
    for s in range(stages):
        block: list[nn.Module] = [nn.Linear(D, D), nn.Dropout(0.25), nn.Tanh()]
        if s == stages - 1:
            block.append(nn.Linear(D, OUT))
        layers += block
        balance.append(len(block))
    return nn.Sequential(*layers).double(), balance


def _pipeline(options: dict[str, Any]) -> tuple[Pipeline, torch.optim.Optimizer]:
    model, balance = _model(world().size)
    pipe = Pipeline(model, balance, chunks=CHUNKS, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    return pipe, opt


def _train(pipe: Pipeline, opt: torch.optim.Optimizer, first: int, calls: int) -> None:
    g = torch.Generator().manual_seed(11)
    data = [
        (
            torch.randn(BATCH, D, generator=g, dtype=torch.float64),
            torch.randint(0, OUT, (BATCH,), generator=g),
        )
        for _ in range(first + calls)
    ]
    for x, y in data[first:]:
        pipe.step(x, y, nn.functional.cross_entropy, opt)
    pipe.flush(opt)


def _params(pipe: Pipeline) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in pipe.parameters()])


SCHEDULES: dict[str, dict[str, Any]] = {
    "1f1b": {"schedule": "1f1b"},
    "async": {
        "schedule": "async",
        "weight_prediction": "msnag",
        "gap_aware": "ga",
        "step_every": 2,
    },
    "async-stashing": {"schedule": "async", "recompute": True, "weight_stashing": True},
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_loaded_pipeline_continues_as_the_original(name: str) -> None:
    original, opt = _pipeline(SCHEDULES[name])
    # 3 calls of 3 micro-batches with step_every=2: the flush steps a partial accumulation.
    _train(original, opt, 0, 3)
    saved = copy.deepcopy((original.state_dict(), opt.state_dict()))
    _train(original, opt, 3, 4)

    resumed, resumed_opt = _pipeline(SCHEDULES[name])
    resumed.load_state_dict(saved[0])
    resumed_opt.load_state_dict(saved[1])
    _train(resumed, resumed_opt, 3, 4)
    assert torch.equal(_params(resumed), _params(original))


def test_state_dict_in_the_middle_of_the_async_stream_is_refused() -> None:
    pipe, opt = _pipeline(SCHEDULES["async"])
    x = torch.randn(BATCH, D, dtype=torch.float64)
    pipe.step(x, torch.randint(0, OUT, (BATCH,)), nn.functional.cross_entropy, opt)
    with pytest.raises(PipelineError, match=r"call pipe.flush\(optimizer\) before saving"):
        pipe.state_dict()
    pipe.flush(opt)
    assert "_extra_state" in pipe.state_dict()


def test_an_async_state_does_not_load_into_a_synchronous_pipeline() -> None:
    pipe, opt = _pipeline(SCHEDULES["async"])
    _train(pipe, opt, 0, 1)
    other, _ = _pipeline(SCHEDULES["1f1b"])
    with pytest.raises(PipelineError, match="saved with async"):
        other.load_state_dict(pipe.state_dict())
