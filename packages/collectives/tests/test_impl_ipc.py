"""``ipc``: CUDA tensors reduced on the GPU through CUDA IPC, against numpy (GPU machines only).

Ranks may share one GPU (a 1-GPU machine) or see several; IPC needs every
rank to see its peers' devices, so the device is chosen by node rank among
all visible ones.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpx.collectives import allreduce, broadcast, world

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]


def _device() -> torch.device:
    return torch.device("cuda", world().node_rank % torch.cuda.device_count())


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str
)
@pytest.mark.parametrize("n", [0, 1, 7, 1000, (1 << 20) + 3, (5 << 20) + 1])
@pytest.mark.parametrize("op", ["sum", "avg", "min"])
def test_allreduce(dtype: torch.dtype, n: int, op: str) -> None:
    comm = world()
    inputs = [
        torch.from_numpy(np.random.default_rng([r, n]).normal(size=n)).to(dtype)
        for r in range(comm.size)
    ]
    t = inputs[comm.rank].to(_device())
    allreduce(t, op, impl="ipc")
    stacked = np.stack([x.double().numpy() for x in inputs])
    want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "min": stacked.min(0)}[op]
    tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
    np.testing.assert_allclose(t.cpu().double().numpy(), want, rtol=tol, atol=tol)


def test_broadcast_repeated_with_async() -> None:
    comm = world()
    for root in range(comm.size):
        t = torch.full(((5 << 20) + 1,), float(comm.rank), device=_device())
        broadcast(t, root, impl="ipc", async_op=True).wait(timeout=120)
        assert torch.all(t == root)
