"""The split backward: W does not run the input-gradient chain of a chunk again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from mpx.collectives import world
from mpx.pipeline import Pipeline

pytestmark = pytest.mark.mpi

WIDTH, LAYERS = 8, 4


class MatmulCounter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Counts the matrix products every pass runs (forward and backward alike)."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # addmm_: W accumulates a weight's gradient into its .grad in place.
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            self.count += 1
        return func(*args, **(kwargs or {}))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(2 * LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def matmuls_and_grads(schedule: str, **options: Any) -> tuple[int, list[torch.Tensor]]:
    """One step of two chunks of LAYERS layers on one rank: matrix products and grads."""
    comm = world()
    solo = comm.split(comm.rank)
    assert solo is not None
    pipe = Pipeline(
        model(), [4 * LAYERS // 2] * 2, comm=solo, chunks=2, schedule=schedule, **options
    )
    x = torch.randn(4, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = torch.randn(4, WIDTH, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with MatmulCounter() as counter:
        pipe.step(x, y, nn.functional.mse_loss)
    return counter.count, [p.grad.clone() for p in pipe.parameters() if p.grad is not None]


def test_w_does_not_recompute_the_input_gradient_inside_a_chunk() -> None:
    # Each Linear: one product forward, two backward (input and weight
    # gradient), except the first layer, whose input needs no gradient. I then
    # W must cost what one full backward costs: before W started from the
    # nodes I saved, it ran the chunk's input-gradient chain again (LAYERS - 1
    # more products per micro-batch on the second chunk).
    full, ref = matmuls_and_grads("interleaved_1f1b", stages_per_rank=2)
    split, grads = matmuls_and_grads("interleaved_zb", stages_per_rank=2)
    per_microbatch = 2 * LAYERS + (2 * LAYERS * 2 - 1)
    assert full == 2 * per_microbatch
    assert split == full
    for a, b in zip(grads, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
