"""torch.distributed on the "mpx" backend, and DDP on it against DDP on gloo."""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at
# runtime (test_ddp_comm_hook_chained_on_the_future_equals_gloo).
import time
from collections.abc import Callable
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from mpx.collectives import CollectiveTimeout, MPXError, world

pytestmark = pytest.mark.mpi


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


# -- every c10d operation against gloo (issue 15) ------------------------------------


def _on_both(
    groups: dict[str, dist.ProcessGroup], run: Callable[[dist.ProcessGroup], object]
) -> None:
    """Runs ``run`` on the mpx group and on the gloo group; their results must be equal."""
    on_gloo = run(groups["gloo"])
    on_mpx = run(groups["mpx"])
    assert _flat(on_mpx) == _flat(on_gloo), f"mpx {on_mpx!r} != gloo {on_gloo!r}"


def _flat(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return (str(value.dtype), tuple(value.shape), value.tolist())
    if isinstance(value, (list, tuple)):
        return [_flat(v) for v in value]
    return value


def _data(
    dtype: torch.dtype, shape: tuple[int, ...] = (2, 3), salt: int = 0, rank: int | None = None
) -> torch.Tensor:
    """A tensor that differs per rank (``rank``'s, this rank's by default), of any dtype."""
    rank = world().rank if rank is None else rank
    base = torch.arange(1, 1 + int(torch.tensor(shape).prod())).reshape(shape) + 3 * rank + salt
    if dtype == torch.bool:
        return (base % 2).bool()
    if dtype.is_complex:
        return torch.complex(base.double(), -base.double()).to(dtype)
    return base.to(dtype)


_FOLD: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "SUM": lambda a, b: a + b if a.dtype != torch.bool else a | b,
    "MAX": torch.maximum,
    "MIN": torch.minimum,
    "PRODUCT": lambda a, b: a * b if a.dtype != torch.bool else a & b,
    "BAND": torch.bitwise_and,
    "BOR": torch.bitwise_or,
    "BXOR": torch.bitwise_xor,
}


def _expected(
    dtype: torch.dtype, op: dist.ReduceOp, shape: tuple[int, ...] = (2, 3)
) -> torch.Tensor:
    """Every rank's ``_data`` reduced in rank order, in the dtype (narrow sums wrap)."""
    fold = _FOLD[str(op).split(".")[-1]]
    out = _data(dtype, shape, rank=0)
    for r in range(1, world().size):
        out = fold(out, _data(dtype, shape, rank=r)).to(dtype)
    return out


REDUCE_CASES = [
    (torch.float32, dist.ReduceOp.SUM),
    (torch.float64, dist.ReduceOp.MAX),
    (torch.int8, dist.ReduceOp.SUM),
    (torch.int8, dist.ReduceOp.PRODUCT),
    (torch.int16, dist.ReduceOp.MIN),
    (torch.int16, dist.ReduceOp.SUM),
    (torch.bool, dist.ReduceOp.SUM),
    (torch.bool, dist.ReduceOp.MIN),
    (torch.complex64, dist.ReduceOp.SUM),
    (torch.int32, dist.ReduceOp.BAND),
    (torch.int64, dist.ReduceOp.BOR),
    (torch.uint8, dist.ReduceOp.BXOR),
    (torch.bool, dist.ReduceOp.BXOR),
]


@pytest.mark.parametrize(("dtype", "op"), REDUCE_CASES, ids=str)
def test_all_reduce_dtypes_and_ops(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype, op: dist.ReduceOp
) -> None:
    """gloo's dtypes and ReduceOps on mpx, against every rank's data reduced here."""
    t = _data(dtype)
    dist.all_reduce(t, op=op, group=groups["mpx"])
    assert torch.equal(t, _expected(dtype, op))
    strided = _data(dtype, (2, 6))[:, ::2]  # a view that is not contiguous
    dist.all_reduce(strided, op=op, group=groups["mpx"])
    assert torch.equal(strided, _expected(dtype, op, (2, 6))[:, ::2])


@pytest.mark.parametrize(("dtype", "op"), REDUCE_CASES, ids=str)
def test_reduce_dtypes_and_ops(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype, op: dist.ReduceOp
) -> None:
    root = world().size - 1
    t = _data(dtype)
    dist.reduce(t, dst=root, op=op, group=groups["mpx"])
    assert torch.equal(t, _expected(dtype, op) if world().rank == root else _data(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8, torch.bool, torch.int16])
def test_data_movement_matches_reference(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype
) -> None:
    """broadcast, all_gather(_into_tensor), gather, scatter and all_to_all_single."""
    size, rank, group = world().size, world().rank, groups["mpx"]
    every = [_data(dtype, rank=r) for r in range(size)]
    b = _data(dtype)
    dist.broadcast(b, src=size - 1, group=group)
    assert torch.equal(b, every[-1])
    outs = [torch.empty((2, 3), dtype=dtype) for _ in range(size)]
    dist.all_gather(outs, _data(dtype), group=group)
    assert all(torch.equal(o, e) for o, e in zip(outs, every, strict=True))
    whole = torch.empty((2 * size, 3), dtype=dtype)
    dist.all_gather_into_tensor(whole, _data(dtype), group=group)
    assert torch.equal(whole, torch.cat(every))
    gathered = [torch.empty((2, 3), dtype=dtype) for _ in range(size)] if rank == 0 else None
    dist.gather(_data(dtype), gathered, dst=0, group=group)
    if gathered is not None:
        assert all(torch.equal(g, e) for g, e in zip(gathered, every, strict=True))
    got = torch.empty((2, 3), dtype=dtype)
    pieces = [_data(dtype, salt=10 * r) for r in range(size)] if rank == 0 else None
    dist.scatter(got, pieces, src=0, group=group)
    assert torch.equal(got, _data(dtype, salt=10 * rank, rank=0))
    mine = torch.empty((size, 3), dtype=dtype)
    dist.all_to_all_single(mine, _data(dtype, (size, 3)), group=group)
    expected = torch.stack([_data(dtype, (size, 3), rank=r)[rank] for r in range(size)])
    assert torch.equal(mine, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8])
def test_data_movement_matches_gloo(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype
) -> None:
    size, rank = world().size, world().rank

    def run(group: dist.ProcessGroup) -> object:
        results: list[object] = []
        b = _data(dtype)
        dist.broadcast(b, src=size - 1, group=group)
        outs = [torch.empty((2, 3), dtype=dtype) for _ in range(size)]
        dist.all_gather(outs, _data(dtype), group=group)
        gathered = [torch.empty((2, 3), dtype=dtype) for _ in range(size)] if rank == 0 else None
        dist.gather(_data(dtype), gathered, dst=0, group=group)
        got = torch.empty((2, 3), dtype=dtype)
        pieces = [_data(dtype, salt=10 * r) for r in range(size)] if rank == 0 else None
        dist.scatter(got, pieces, src=0, group=group)
        results += [b, outs, gathered, got]
        return results

    _on_both(groups, run)


def test_uneven_all_to_all_matches_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    size, rank = dist.get_world_size(), dist.get_rank()
    # Rank r sends r + j + 1 rows to rank j.
    send_rows = [rank + j + 1 for j in range(size)]
    recv_rows = [j + rank + 1 for j in range(size)]

    def run(group: dist.ProcessGroup) -> object:
        out = torch.empty((sum(recv_rows), 2))
        data = torch.arange(sum(send_rows) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
        dist.all_to_all_single(out, data, recv_rows, send_rows, group=group)
        return out

    _on_both(groups, run)
    # The list form with blocks of different sizes (gloo refuses them).
    outs = [torch.empty(n, dtype=torch.int64) for n in recv_rows]
    ins = [torch.full((n,), 10 * rank + j, dtype=torch.int64) for j, n in enumerate(send_rows)]
    dist.all_to_all(outs, ins, group=groups["mpx"])
    assert [o.tolist() for o in outs] == [[10 * j + rank] * n for j, n in enumerate(recv_rows)]


def test_all_to_all_single_refuses_non_contiguous_like_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """c10d's all_to_all_single takes a contiguous input: a strided one is a ValueError."""
    size = dist.get_world_size()
    every_other = torch.arange(size * 4.0)[::2]  # strided at any world size, 1 included
    for name, group in groups.items():
        with pytest.raises(ValueError, match="Tensors must be contiguous") as raised:
            dist.all_to_all_single(torch.zeros(size * 2), every_other, group=group)
        if name == "mpx":
            assert "input.contiguous()" in str(raised.value)  # the fix, named
        # The group is still usable, and a channels-last tensor (gloo takes it) passes.
        images = torch.arange(size * 8.0).reshape(size, 2, 2, 2)
        out = torch.empty_like(images).to(memory_format=torch.channels_last)
        dist.all_to_all_single(out, images.to(memory_format=torch.channels_last), group=group)
        assert out.shape == images.shape


def test_reduce_scatter_forms_match_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    size = dist.get_world_size()

    def run(group: dist.ProcessGroup) -> object:
        out = torch.empty(1, 3)
        dist.reduce_scatter_tensor(out, _data(torch.float32, (size, 3)), group=group)
        ints = torch.empty(1, 2, dtype=torch.int64)
        dist.reduce_scatter_tensor(
            ints, _data(torch.int64, (size, 2)), op=dist.ReduceOp.MAX, group=group
        )
        return [out, ints]

    _on_both(groups, run)
    # Blocks of different sizes (rank r gets r + 1 elements), in a dtype gloo lacks.
    rank = world().rank
    out = torch.empty(rank + 1, dtype=torch.int16)
    blocks = [torch.full((r + 1,), rank + 1, dtype=torch.int16) for r in range(size)]
    dist.reduce_scatter(out, blocks, group=groups["mpx"])
    assert out.tolist() == [size * (size + 1) // 2] * (rank + 1)


def test_coalesced_forms_match_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    size = dist.get_world_size()

    def run(group: dist.ProcessGroup) -> object:
        tensors = [_data(torch.float32), _data(torch.float32, (4,))]
        dist.all_reduce_coalesced(tensors, group=group)
        outs = [[torch.empty((2, 3)), torch.empty(4)] for _ in range(size)]
        dist.all_gather_coalesced(outs, [_data(torch.float32), _data(torch.float32, (4,))], group)
        return [tensors, outs]

    _on_both(groups, run)


def test_objects_match_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    size, rank = dist.get_world_size(), dist.get_rank()

    def run(group: dist.ProcessGroup) -> object:
        every: list[object] = [None] * size
        dist.all_gather_object(every, {"rank": rank, "pad": "x" * rank}, group=group)
        gathered: list[object] | None = [None] * size if rank == 0 else None
        dist.gather_object(("from", rank), gathered, dst=0, group=group)
        mine: list[object] = [None]
        dist.scatter_object_list(mine, [f"to {r}" for r in range(size)], src=0, group=group)
        told = [rank, "b"] if rank == 0 else [None, None]
        dist.broadcast_object_list(told, src=0, group=group)
        return [every, gathered, mine, told]

    _on_both(groups, run)


def test_point_to_point_matches_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    size, rank = dist.get_world_size(), dist.get_rank()
    right, left = (rank + 1) % size, (rank - 1) % size

    def run(group: dist.ProcessGroup) -> object:
        got = torch.empty(3, dtype=torch.int8)
        if size == 1:
            return None
        ops = [
            dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int8), right, group),
            dist.P2POp(dist.irecv, got, left, group),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        # send/recv, then a receive from any source.
        if rank == 0:
            dist.send(torch.tensor([7.0, 8.0]), dst=1, group=group)
            back = torch.empty(1)
            source = dist.recv(back, group=group)
            return [got, back, source]
        mine = torch.empty(2)
        if rank == 1:
            dist.recv(mine, src=0, group=group)
            dist.send(torch.tensor([float(rank)]), dst=0, group=group)
        return [got, mine if rank == 1 else None]

    _on_both(groups, run)


def test_unsupported_names_mpx_and_the_op(groups: dict[str, dist.ProcessGroup]) -> None:
    with pytest.raises(MPXError, match=r"allreduce.*BAND needs an integer"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND, group=groups["mpx"])
    with pytest.raises(MPXError, match=r"all_gather.*one output tensor per rank"):
        dist.all_gather([torch.empty(1)] * (world().size + 1), torch.ones(1), groups["mpx"])


def test_sparse_all_reduce_matches_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    rank = dist.get_rank()

    def run(group: dist.ProcessGroup) -> object:
        indices = torch.tensor([[rank, rank + 1]])
        t = torch.sparse_coo_tensor(
            indices, torch.tensor([1.0, 2.0 + rank]), (8,), check_invariants=True
        )
        dist.all_reduce(t, group=group)
        return t.to_dense()

    _on_both(groups, run)


def test_process_group_calling_conventions(groups: dict[str, dist.ProcessGroup]) -> None:
    """``pg.allreduce(tensor)``, ``pg.broadcast(tensor, root)`` and list forms, as on gloo."""
    size = dist.get_world_size()

    def run(group: dist.ProcessGroup) -> object:
        t = torch.ones(3, 2)
        fut = group.allreduce(t).get_future()
        value = fut.wait()
        b = torch.full((2,), float(dist.get_rank()))
        group.broadcast(b, 0).wait()
        return [value, b, size]

    _on_both(groups, run)


def test_subgroups_not_spanning_every_rank(groups: dict[str, dist.ProcessGroup]) -> None:
    """new_group of the first size-1 ranks (all at 1 rank), new_subgroups, destroy(group)."""
    size, rank = dist.get_world_size(), dist.get_rank()
    members = list(range(max(1, size - 1)))
    mpx_sub = dist.new_group(members, backend="mpx")
    gloo_sub = dist.new_group(members, backend="gloo")
    if rank in members:
        on_mpx, on_gloo = _data(torch.float32), _data(torch.float32)
        dist.all_reduce(on_mpx, group=mpx_sub)
        dist.all_reduce(on_gloo, group=gloo_sub)
        assert torch.equal(on_mpx, on_gloo)
        outs = [torch.empty(2, 3) for _ in members]
        dist.all_gather(outs, _data(torch.float32), group=mpx_sub)
        assert [o[0, 0].item() for o in outs] == [1.0 + 3 * r for r in members]
    else:
        assert mpx_sub == dist.GroupMember.NON_GROUP_MEMBER
    dist.destroy_process_group(mpx_sub)
    dist.destroy_process_group(gloo_sub)
    mine, _ = dist.new_subgroups(group_size=1, backend="mpx")  # type: ignore[no-untyped-call]
    one = torch.full((2,), float(rank + 1))
    dist.all_reduce(one, group=mine)  # a group of one rank: unchanged
    assert one.tolist() == [rank + 1.0] * 2
    dist.barrier(group=groups["mpx"])


def test_group_timeout_is_honoured(groups: dict[str, dist.ProcessGroup]) -> None:
    """A peer that never sends: the receive raises after the group's timeout, as on gloo."""
    group = dist.new_group(backend="mpx", timeout=timedelta(seconds=1))
    work = group.recv([torch.empty(1)], dist.get_rank(), 99)
    with pytest.raises(CollectiveTimeout) as raised:
        work.wait()
    assert raised.value.seconds == 1
    dist.destroy_process_group(group)


def test_keyword_forms_and_several_tensors_match_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    """``pg.allreduce(t, op=...)``, ``pg.broadcast(t, root=...)``; a list: one value over all."""
    rank = dist.get_rank()

    def run(group: dist.ProcessGroup) -> object:
        t = torch.full((2,), float(rank + 1))
        group.allreduce(t, op=dist.ReduceOp.MAX).wait()
        b = torch.full((2,), float(rank))
        group.broadcast(b, root=0).wait()
        several = [torch.full((2,), 1.0 + rank), torch.full((2,), 2.0 + rank)]
        group.allreduce(several).wait()
        return [t, b, several]

    _on_both(groups, run)


def test_ddp_with_sparse_embedding_bag_equals_gloo(groups: dict[str, dist.ProcessGroup]) -> None:
    """DDP with ``EmbeddingBag(sparse=True)``: sparse gradients summed as gloo sums them."""

    def train(group: dist.ProcessGroup) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.EmbeddingBag(20, 4, mode="sum", sparse=True)
        ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        data = torch.Generator().manual_seed(world().rank)
        for _ in range(3):
            opt.zero_grad()
            ddp(torch.randint(0, 20, (6,), generator=data), torch.tensor([0, 3])).sum().backward()
            opt.step()
        return model.weight.detach().clone()

    assert torch.equal(train(groups["mpx"]), train(groups["gloo"]))


# -- asynchronous work, as gloo's (issue 15) ------------------------------------------
#
# Each test runs on the mpx group and on the gloo group. A late rank 0 is made by a
# message, not a sleep: every other rank starts its operation, takes the future,
# and only then tells rank 0 to join. A backend whose get_future() waits for the
# operation deadlocks here (the test's timeout fails it).

BACKENDS = ["gloo", "mpx"]
_GO_TAG = 4715  # rank 0's signal to join, on MPI's world communicator (not mpx's)


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


# -- c10d's corners (issue 31) --------------------------------------------------------


def test_allreduce_coalesced_reduces_a_repeated_tensor_once_as_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """One tensor twice in the list, and overlapping views: each reduced from its value before."""
    rank = dist.get_rank()

    def run(group: dist.ProcessGroup) -> object:
        t = torch.full((3,), 1.0 + rank)
        group.allreduce_coalesced([t, t]).wait()
        base = torch.arange(6.0) + rank
        group.allreduce_coalesced([base[:4], base[2:]]).wait()
        apart = [torch.full((2,), 1.0 + rank), torch.full((3,), 2.0 * rank)]
        group.allreduce_coalesced(apart).wait()
        return [t, base, apart]

    _on_both(groups, run)


def test_allgather_of_several_inputs_per_rank_matches_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """c10d's form: k inputs, k output lists of size * k tensors, [r * k + j] = rank r's input j."""
    rank, size = dist.get_rank(), dist.get_world_size()

    def run(group: dist.ProcessGroup) -> object:
        inputs = [torch.full((2,), 10.0 * rank + j) for j in range(3)]
        outputs = [[torch.zeros(2) for _ in range(size * 3)] for _ in range(3)]
        group.allgather(outputs, inputs).wait()
        return outputs

    _on_both(groups, run)
    with pytest.raises(MPXError, match=r"world size x inputs = \d+ x 2"):
        groups["mpx"].allgather([[torch.zeros(1)] * size] * 2, [torch.zeros(1)] * 2)
    with pytest.raises(MPXError, match=r"one output list per input tensor \(2\), got 1"):
        groups["mpx"].allgather([[torch.zeros(1)] * (2 * size)], [torch.zeros(1)] * 2)


def test_every_op_of_the_table_has_its_process_group_method() -> None:
    """op_specs.OP_SPECS names the c10d method each op backs: MPXProcessGroup defines each one.

    An op added to the one table of op specs without its torch method here
    would reach ``dist.ProcessGroup``'s C++ default ("not supported") instead.
    """
    from mpx.collectives.core.op_specs import OP_SPECS
    from mpx.collectives.torch.backend import MPXProcessGroup

    # Defined by mpx's classes (the group and its base), not inherited from torch's.
    defined = {
        name
        for cls in MPXProcessGroup.__mro__
        if cls.__module__.startswith("mpx.")
        for name in vars(cls)
    }
    missing = [s.c10d for s in OP_SPECS.values() if s.c10d not in defined]
    assert missing == []
