"""skippable/stash/pop and Keyed in one process: the model runs as an ordinary one."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import nn

from mpx.pipeline import Keyed, PipelineError, pop, skippable, stash
from mpx.pipeline.model.skip import Pop, Stash, check_skips, tracking, uses_skips

Steps = Generator[Stash | Pop, Any, torch.Tensor]


@skippable(stash=["a"])
class Keep(nn.Module):
    def forward(self, x: torch.Tensor) -> Steps:
        yield stash("a", x)
        return x * 2


@skippable(pop=["a"])
class Add(nn.Module):
    def forward(self, x: torch.Tensor) -> Steps:
        a: torch.Tensor = yield pop("a")
        return x + a


@skippable(stash=["b"])
class Undeclared(nn.Module):
    def forward(self, x: torch.Tensor) -> Steps:
        yield stash("a", x)
        return x


def test_a_skip_model_runs_unpartitioned_and_inside_a_tracker() -> None:
    model = nn.Sequential(Keep(), nn.Identity(), Add())
    x = torch.ones(2)
    assert torch.equal(model(x), 3 * x)
    assert uses_skips(model)
    assert not uses_skips(nn.Sequential(nn.Identity()))
    check_skips(list(model))
    skips: dict[str, torch.Tensor] = {}
    with tracking(skips):
        model[0](x)
    assert torch.equal(skips["a"], x)  # what a stage border would carry


def test_skip_declarations_are_checked() -> None:
    with pytest.raises(PipelineError, match="layer 0 pops skip 'a', which no earlier"):
        check_skips([Add(), Keep()])
    with pytest.raises(PipelineError, match="layer 1 stashes skip 'a', which no later"):
        check_skips([nn.Identity(), Keep()])
    with pytest.raises(PipelineError, match="stashes skip 'a' again"):
        check_skips([Keep(), Keep(), Add()])
    with pytest.raises(PipelineError, match=r"stashes 'a' but declares stash=\['b'\]"):
        Undeclared()(torch.ones(1))


class Scale(nn.Module):
    def forward(self, h: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return h * k


def test_keyed_reads_writes_and_drops() -> None:
    step = Keyed(Scale(), ["h", "k"], "h", drop=["k"])
    out = step({"h": torch.ones(2), "k": torch.full((2,), 3.0), "n": 1})
    assert set(out) == {"h", "n"}
    assert torch.equal(out["h"], torch.full((2,), 3.0))
    pair = Keyed(nn.Identity(), "h", ["a", "b"])
    with pytest.raises(PipelineError, match="return a tuple of 2"):
        pair({"h": torch.ones(1)})
    with pytest.raises(PipelineError, match=r"reads \['k'\], not among \['h'\]"):
        step({"h": torch.ones(1)})
    with pytest.raises(TypeError, match="got a Tensor"):
        step(torch.ones(1))
