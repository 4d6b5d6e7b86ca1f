"""torch.distributed on the "mpx" backend, and DDP on it against DDP on gloo."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mpx.collectives import init_process_group, world
from mpx.launch import init_torch_env

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[str, dist.ProcessGroup]]:
    """The default group on mpx (env:// store) and a gloo group over the same ranks."""
    init_torch_env()
    init_process_group("env://")
    gloo = dist.new_group(backend="gloo")
    default = dist.group.WORLD
    assert default is not None
    yield {"mpx": default, "gloo": gloo}
    dist.destroy_process_group()


def test_backend_collectives(groups: dict[str, dist.ProcessGroup]) -> None:
    comm = world()
    assert dist.get_backend() == "mpx"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
    t = torch.full((5,), float(comm.rank + 1))
    dist.all_reduce(t)
    assert t.eq(comm.size * (comm.size + 1) / 2).all()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    b = torch.full((3,), float(comm.rank))
    dist.broadcast(b, src=comm.size - 1)
    assert b.eq(comm.size - 1).all()
    outs = [torch.empty(2) for _ in range(comm.size)]
    dist.all_gather(outs, torch.full((2,), float(comm.rank)))
    assert [o[0].item() for o in outs] == [float(r) for r in range(comm.size)]
    work = dist.all_reduce(torch.ones(4), async_op=True)
    assert work.wait()
    dist.barrier()


def _train(group: dist.ProcessGroup, steps: int = 5) -> list[torch.Tensor]:
    comm = world()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group, bucket_cap_mb=1)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + comm.rank)  # each rank its own batch
    for _ in range(steps):
        x = torch.randn(16, 8, generator=data, dtype=torch.float64)
        y = torch.randint(0, 3, (16,), generator=data)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_ddp_on_mpx_equals_ddp_on_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    on_mpx = _train(groups["mpx"])
    on_gloo = _train(groups["gloo"])
    for a, b in zip(on_mpx, on_gloo, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # And every rank holds the same parameters.
    flat = torch.cat([p.flatten() for p in on_mpx])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    assert torch.equal(flat, reference)
