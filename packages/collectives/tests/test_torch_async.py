"""Asynchronous work on the "mpx" backend behaves as gloo's (issue 15).

Each test runs on the mpx group and on a gloo group over the same ranks. A
late rank 0 is made by a message, not a sleep: every other rank starts its
operation, takes the future, and only then tells rank 0 to join. A backend
whose ``get_future()`` waits for the operation deadlocks here (the test's
timeout fails it).
"""

import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives import CollectiveTimeout, init_process_group, world
from mpx.launch import init_torch_env

pytestmark = pytest.mark.mpi

BACKENDS = ["gloo", "mpx"]
_GO_TAG = 4715  # rank 0's signal to join, on MPI's world communicator (not mpx's)


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


def _until(done: Callable[[], bool]) -> None:
    """Polls ``done()`` until True (the test's timeout bounds it); never waits on the work."""
    while not done():
        time.sleep(1e-3)


def _rank_0_joins_when_told(start: Callable[[], None]) -> None:
    """Rank 0 waits for every other rank's go before it calls ``start()``; the others after."""
    mpi = MPI.COMM_WORLD
    if mpi.Get_rank() == 0:
        for peer in range(1, mpi.Get_size()):
            mpi.recv(source=peer, tag=_GO_TAG)
        start()
    else:
        start()
        mpi.send(None, dest=0, tag=_GO_TAG)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_future_completes_by_itself_while_rank_0_is_late(
    groups: dict[str, dist.ProcessGroup], backend: str
) -> None:
    group = groups[backend]
    rank, size = dist.get_rank(), dist.get_world_size()
    t = torch.full((1000,), float(rank + 1))
    chained: list[torch.futures.Future[torch.Tensor]] = []
    seen_before_go: list[bool] = []

    def start() -> None:
        work = dist.all_reduce(t, group=group, async_op=True)
        assert work is not None
        future = work.get_future()  # returns at once, as DDP's comm hook needs
        seen_before_go.append(future.done() or work.is_completed())
        chained.append(future.then(lambda f: f.value()[0] * 2))

    _rank_0_joins_when_told(start)
    if rank != 0 and size > 1:
        assert seen_before_go == [False], "the work completed before rank 0 joined"
    _until(chained[0].done)  # nobody calls wait(): the backend completes the future itself
    total = size * (size + 1) / 2
    assert torch.equal(chained[0].value(), torch.full((1000,), 2 * total))
    assert torch.equal(t, torch.full((1000,), total))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_is_completed_means_the_outputs_are_written(
    groups: dict[str, dist.ProcessGroup], backend: str
) -> None:
    group = groups[backend]
    rank, size = dist.get_rank(), dist.get_world_size()
    outputs = [torch.zeros(3) for _ in range(size)]
    work = dist.all_gather(outputs, torch.full((3,), float(rank + 1)), group=group, async_op=True)
    assert work is not None
    _until(work.is_completed)
    assert [o.tolist() for o in outputs] == [[r + 1.0] * 3 for r in range(size)]
    assert work.wait()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", BACKENDS)
def test_futures_complete_in_any_order_of_taking(
    groups: dict[str, dist.ProcessGroup], backend: str
) -> None:
    """Several works in flight (DDP's buckets); the futures taken last-first all complete."""
    group = groups[backend]
    rank, size = dist.get_rank(), dist.get_world_size()
    tensors = [torch.full((n,), float(rank)) for n in (10, 100_000, 7, 300_000)]
    works = [dist.all_reduce(t, group=group, async_op=True) for t in tensors]
    futures = [w.get_future() for w in reversed(works) if w is not None]
    for future in futures:
        _until(future.done)
    total = float(sum(range(size)))
    assert all(torch.equal(t, torch.full_like(t, total)) for t in tensors)


@pytest.mark.timeout(120)
def test_future_fails_at_the_group_timeout(groups: dict[str, dist.ProcessGroup]) -> None:
    """A receive that never matches: its future raises after the group's timeout by itself."""
    group = dist.new_group(backend="mpx", timeout=timedelta(seconds=1))
    work = group.recv([torch.empty(1)], dist.get_rank(), 98)
    future = work.get_future()  # does not raise: the error belongs to the future
    _until(future.done)
    with pytest.raises(CollectiveTimeout) as raised:
        future.wait()
    assert raised.value.seconds == 1
    with pytest.raises(CollectiveTimeout):
        work.wait()
    dist.destroy_process_group(group)
    dist.barrier(group=groups["mpx"])


@pytest.mark.timeout(120)
def test_ddp_comm_hook_chained_on_the_future_equals_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """DDP with a Python comm hook that chains on the work's future, several buckets."""
    comm = world()

    def train(group: dist.ProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(6)]).double()
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=0.04
        )

        def hook(
            state: object,
            bucket: dist.GradBucket,  # type: ignore[name-defined]  # (torch's stubs lack it)
        ) -> torch.futures.Future[torch.Tensor]:
            work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
            assert work is not None
            averaged: torch.futures.Future[torch.Tensor] = work.get_future().then(
                lambda f: f.value()[0] / comm.size
            )
            return averaged

        ddp.register_comm_hook(None, hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(7 + comm.rank)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randn(8, 64, generator=data, dtype=torch.float64)).sum().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    on_mpx = train(groups["mpx"])
    on_gloo = train(groups["gloo"])
    for a, b in zip(on_mpx, on_gloo, strict=True):  # 3 ranks sum in another order than gloo
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
