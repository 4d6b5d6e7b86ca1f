"""ParameterServer rules and progress; Downpour and EASGD converge on least squares.

The convex problem is consistent (b = A x*): every rank's own rows determine
x*, so asynchronous methods must reach it whatever the ranks' relative speed.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpx.dataparallel as dp
from mpx.dataparallel.errors import ParameterServerError

pytestmark = pytest.mark.mpi


def test_rules_add_copy_zero() -> None:
    size, rank = dp.world_size(), dp.rank()
    with dp.ParameterServer() as ps:
        key = ps.register(torch.zeros(3, 5, dtype=torch.float64))
        other = ps.register(torch.arange(7, dtype=torch.float32))  # 7 does not divide by 2, 3
        ps.push(key, torch.full((3, 5), float(rank + 1), dtype=torch.float64), "add")
        ps.fence()
        total = sum(r + 1 for r in range(size))
        assert torch.equal(ps.pull(key), torch.full((3, 5), float(total), dtype=torch.float64))
        ps.fence()
        if rank == size - 1:
            ps.push(other, torch.arange(7, dtype=torch.float32) * 10, "copy")
        ps.fence()
        out = torch.empty(7)
        assert ps.pull(other, out=out) is out
        assert torch.equal(out, torch.arange(7, dtype=torch.float32) * 10)
        ps.fence()
        if rank == 0:
            ps.push(key, None, "zero")
        ps.fence()
        assert torch.equal(ps.pull(key), torch.zeros(3, 5, dtype=torch.float64))
        # Each rank serves its contiguous shard: the shards tile the tensor.
        shards = MPI.COMM_WORLD.allgather(ps.shard(other))
        assert torch.equal(torch.cat(shards), out)


def test_async_handles_and_ordering_per_client() -> None:
    with dp.ParameterServer() as ps:
        key = ps.register(torch.zeros(1000))
        handles = [ps.push(key, torch.ones(1000), "add", async_op=True) for _ in range(5)]
        pulled = ps.pull(key, async_op=True)
        assert isinstance(pulled, dp.PSHandle)
        value = pulled.wait()
        for h in handles:
            assert h is not None
            h.wait()
        # My 5 pushes were sent before my pull: each server applied them first.
        assert bool((value >= 5).all())
        ps.fence()
        assert torch.equal(ps.pull(key), torch.full((1000,), 5.0 * dp.world_size()))


def test_servers_progress_while_their_owner_is_busy() -> None:
    with dp.ParameterServer() as ps:
        key = ps.register(torch.arange(6.0))
        MPI.COMM_WORLD.Barrier()
        if dp.rank() == 0:
            time.sleep(1.0)  # rank 0's training loop is busy, never calls the server
            elapsed = 0.0
        else:
            start = time.monotonic()
            for _ in range(20):
                ps.pull(key)  # a shard lives on rank 0
            elapsed = time.monotonic() - start
        assert elapsed < 0.9, f"20 pulls took {elapsed:.2f} s while rank 0 was busy"


def test_bad_input() -> None:
    with dp.ParameterServer() as ps:
        key = ps.register(torch.zeros(4))
        with pytest.raises(ValueError, match="rule must be one of add, copy, zero, got 'mul'"):
            ps.push(key, torch.zeros(4), "mul")
        with pytest.raises(ValueError, match=r"holds shape \(4,\), got \(5,\)"):
            ps.push(key, torch.zeros(5))
        with pytest.raises(ValueError, match="unknown key 3"):
            ps.pull(3)
        with pytest.raises(ValueError, match="out is"):
            ps.pull(key, out=torch.zeros(4, dtype=torch.float64))
        if dp.world_size() > 1:  # (one rank has nobody to differ from)
            with pytest.raises(ValueError, match="ranks passed different tensors"):
                ps.register(torch.zeros(2 + dp.rank() % 2))
    with pytest.raises(ParameterServerError, match="closed"):
        ps.pull(key)


def _problem(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x_star = torch.from_numpy(np.random.default_rng(0).normal(size=(6, 1)))
    a = torch.from_numpy(np.random.default_rng(1 + rank).normal(size=(30, 6)))
    return a, a @ x_star, x_star


def _train(make_opt: str, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    a, b, x_star = _problem(dp.rank())
    torch.manual_seed(dp.rank())  # different starts: the optimizer must take root's
    model = nn.Linear(6, 1, bias=False).double()
    ps = dp.ParameterServer()
    opt: dp.DownpourSGD | dp.EASGD
    if make_opt == "downpour":
        opt = dp.DownpourSGD(model.parameters(), ps, lr=0.1 / dp.world_size(), push_every=2)
    else:
        opt = dp.EASGD(model.parameters(), ps, lr=0.1, tau=2)
    for step in range(steps):
        rows = slice((step * 10) % 30, (step * 10) % 30 + 10)  # mini-batches of own rows
        opt.zero_grad()
        nn.functional.mse_loss(model(a[rows]), b[rows]).backward()
        opt.step()
    opt.pull_parameters()
    ps.close()
    return model.weight.detach().reshape(-1, 1), x_star


@pytest.mark.parametrize("method", ["downpour", "easgd"])
def test_async_sgd_converges_on_least_squares(method: str) -> None:
    found, x_star = _train(method, steps=400)
    torch.testing.assert_close(found, x_star, rtol=0, atol=1e-4)
    for other in MPI.COMM_WORLD.allgather(found):
        assert torch.equal(other, found)  # everyone ends on the server's values


def test_optimizer_arguments() -> None:
    with dp.ParameterServer() as ps:
        p = [nn.Parameter(torch.zeros(2))]
        with pytest.raises(ValueError, match="push_every must be an int >= 1, got 0"):
            dp.DownpourSGD(p, ps, lr=0.1, push_every=0)
        with pytest.raises(ValueError, match="tau must be an int >= 1"):
            dp.EASGD(p, ps, lr=0.1, tau=0)
        with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\), got 2"):
            dp.EASGD(p, ps, lr=0.1, alpha=2)
        with pytest.raises(TypeError, match="server must be a ParameterServer"):
            dp.EASGD(p, None, lr=0.1)  # type: ignore[arg-type]


def test_close_frees_its_communicator_once_and_use_after_it_names_close() -> None:
    """Each server's duplicate is freed by close() (collective, idempotent); the caller's
    communicator stays open. More servers than MPICH has communicators (2048) in a row
    run only because each close() gives its duplicate back."""
    world = dp.init()
    for _ in range(2100):
        ps = dp.ParameterServer(world)
        made = ps._mpi
        ps.close()
        assert made == MPI.COMM_NULL  # mpi4py empties the handle MPI_Comm_free freed
    ps = dp.ParameterServer(world)
    key = ps.register(torch.zeros(4))
    ps.close()
    ps.close()  # a second close() does nothing (no second fence, no double free)
    assert world.mpi != MPI.COMM_NULL
    for use in (lambda: ps.pull(key), lambda: ps.push(key, torch.zeros(4)), ps.fence):
        with pytest.raises(ParameterServerError, match=r"closed: close\(\) freed"):
            use()
