"""Each CUDA implementation runs every dtype and reduce op it declares (GPU machines only).

The registry's ``dtypes`` and ``reduce_ops`` say what an implementation takes;
``auto`` trusts them and ``impl=`` refuses what they leave out. The CPU
implementations were probed at 2 and 3 ranks; this is the same probe for the
CUDA ones (``staged``, ``ipc``, ``nccl``), each allreduce against numpy in
float64 on the same inputs. An implementation that fails here must narrow its
declaration (or be fixed), not be left to fail at a user's call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from mpx.collectives import allreduce, world
from mpx.collectives.base.dtypes import REDUCE_OPS, SUPPORTED_DTYPES
from mpx.collectives.core.registry import all_implementations

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

CUDA_IMPLS = sorted(
    name
    for name, impl in all_implementations().items()
    if "cuda" in impl.devices and "allreduce" in impl.provides
)


def _device() -> torch.device:
    return torch.device("cuda", world().node_rank % torch.cuda.device_count())


def _cases() -> list[tuple[str, torch.dtype, str]]:
    cases = []
    for name in CUDA_IMPLS:
        impl = all_implementations()[name]
        for dtype in sorted(impl.dtypes or SUPPORTED_DTYPES, key=str):
            for op in sorted(impl.reduce_ops or REDUCE_OPS):
                if op == "avg" and not dtype.is_floating_point:
                    continue  # refused for every implementation before dispatch
                cases.append((name, dtype, op))
    return cases


def _inputs(rank: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    rng = np.random.default_rng([rank, n])
    if op == "prod":  # values near 1: a product of a few stays in every dtype's range
        values = rng.choice([1.0, 2.0] if not dtype.is_floating_point else [0.5, 1.0, 2.0], n)
    elif dtype.is_floating_point:
        values = rng.normal(size=n)
    else:
        values = rng.integers(0, 50, n)
    return torch.from_numpy(np.asarray(values)).to(dtype)


@pytest.mark.parametrize(("name", "dtype", "op"), _cases(), ids=str)
def test_allreduce_takes_what_it_declares(name: str, dtype: torch.dtype, op: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    comm = world()
    if name == "nccl" and torch.cuda.device_count() < comm.node_size:
        # NCCL refuses two ranks on one device ("Duplicate GPU detected").
        pytest.skip(f"NCCL needs a GPU per rank: {comm.node_size} ranks share "
                    f"{torch.cuda.device_count()} GPU(s) on this node")  # fmt: skip
    n = 1000 + 3  # not a multiple of any slot or bucket
    inputs = [_inputs(r, n, dtype, op) for r in range(comm.size)]
    t = inputs[comm.rank].to(_device())
    allreduce(t, op, impl=name, timeout=120)
    stacked = np.stack([x.double().numpy() for x in inputs])
    reductions: dict[str, Callable[..., Any]] = {
        "sum": np.sum,
        "avg": np.mean,
        "max": np.max,
        "min": np.min,
        "prod": np.prod,
    }
    want = reductions[op](stacked, axis=0)  # integers stay below 256: no dtype wraps
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-6)
    np.testing.assert_allclose(t.cpu().double().numpy(), want, rtol=tol, atol=tol)
