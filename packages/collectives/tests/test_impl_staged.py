"""``staged``: CUDA tensors through pinned host memory, against numpy (GPU machines only)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mpx.collectives import (
    Handle,
    allgather,
    allreduce,
    broadcast,
    recv,
    reduce_scatter,
    send,
    world,
)
from mpx.collectives.core import policy
from mpx.collectives.core.policy import choose

pytestmark = [pytest.mark.mpi, pytest.mark.gpu]

SIZES = [0, 1, 7, 1000, (1 << 20) + 3, (3 << 20) + 5]  # the last spans several 4 MiB chunks
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.uint8]


def _device() -> torch.device:
    return torch.device("cuda", world().node_rank % torch.cuda.device_count())


def _make(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    rng = np.random.default_rng([rank, n])
    if dtype.is_floating_point:
        return torch.from_numpy(rng.normal(size=n)).to(dtype)
    return torch.from_numpy(rng.integers(0, 50, n)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("async_op", [False, True])
def test_allreduce(dtype: torch.dtype, n: int, op: str, async_op: bool) -> None:
    comm = world()
    inputs = [_make(r, n, dtype) for r in range(comm.size)]
    t = inputs[comm.rank].to(_device())
    # auto takes ipc for large CUDA calls where every rank sees the same GPUs.
    ipc = comm.size > 1 and comm.gpus_shared and t.nbytes >= policy.current().ipc_bytes
    assert choose("allreduce", t.is_cuda, t.nbytes, comm) == ("ipc" if ipc else "staged")
    result = allreduce(t, op, async_op=async_op, impl="staged")
    if async_op:
        assert isinstance(result, Handle)
        result = result.wait(timeout=120)
    assert result is t
    assert t.is_cuda
    stacked = np.stack([x.double().numpy() for x in inputs])
    want = stacked.sum(0) if op == "sum" else stacked.max(0)
    if dtype.is_floating_point:
        tol = {torch.float16: 1e-2, torch.bfloat16: 5e-2}.get(dtype, 1e-5)
        np.testing.assert_allclose(t.cpu().double().numpy(), want, rtol=tol, atol=tol)
    else:
        np.testing.assert_array_equal(
            t.cpu().double().numpy() % 256 if dtype == torch.uint8 else t.cpu().double().numpy(),
            want % 256 if dtype == torch.uint8 else want,
        )


@pytest.mark.parametrize("n", [1, (3 << 20) + 5])
def test_broadcast_and_allgather(n: int) -> None:
    comm = world()
    for root in range(comm.size):
        t = torch.full((n,), float(comm.rank), device=_device())
        broadcast(t, root, impl="staged")
        assert torch.all(t == root)
    gathered = allgather(torch.full((n,), float(comm.rank), device=_device()))
    assert gathered.is_cuda
    assert gathered[:, 0].tolist() == [float(r) for r in range(comm.size)]


def test_reduce_scatter_and_point_to_point() -> None:
    comm = world()
    rows = torch.arange(comm.size * 4, dtype=torch.float32, device=_device()).reshape(comm.size, 4)
    mine = reduce_scatter(rows)
    torch.testing.assert_close(mine.cpu(), rows[comm.rank : comm.rank + 1].cpu() * comm.size)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    incoming = torch.empty(1000, device=_device())
    handle = recv(incoming, left, tag=5, async_op=True)
    send(torch.full((1000,), float(comm.rank), device=_device()), right, tag=5)
    handle.wait(timeout=60)
    assert torch.all(incoming == left)
