"""The mpx group's allreduce of a tensor past ``MPX_SHM_FLAG_BYTES``: in flag-kernel pieces.

DDP's 25 MB buckets went through shm's Python pieces (three barriers each, a
turn of the progress thread between); the group now cuts them into pieces the
flag kernel takes. Each test runs at any world size: on one rank nothing is
cut (the flag kernel needs peers), and the sums are checked against every
rank's data rebuilt here.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from mpx.collectives import world
from mpx.collectives.node import shm_flags
from mpx.collectives.torch.work import MPXWork
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi

LIMIT = 64 << 10  # MPX_SHM_FLAG_BYTES for these tests: small tensors already cross it


@pytest.fixture
def small_flag_bytes(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setenv("MPX_SHM_FLAG_BYTES", str(LIMIT))
    reload_settings()
    yield LIMIT
    monkeypatch.delenv("MPX_SHM_FLAG_BYTES")
    reload_settings()


def _data(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s tensor: small integers, so every sum is exact in any order."""
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randint(-50, 50, (n,), generator=g).to(dtype)


def _pieces_expected(nbytes: int) -> int:
    comm = world()
    cut = shm_flags.AVAILABLE and comm.size > 1 and comm.single_node
    return -(-nbytes // LIMIT) if cut else 1


@pytest.mark.parametrize(
    ("dtype", "average", "n"),
    [
        (torch.float32, False, 100_003),  # 7 pieces, the last one shorter
        (torch.float64, True, 40_000),  # 5 pieces
        (torch.int64, False, 8_192),  # exactly the limit: one piece
    ],
)
def test_allreduce_past_the_flag_limit_runs_in_pieces(
    groups: dict[str, dist.ProcessGroup],
    small_flag_bytes: int,
    dtype: torch.dtype,
    average: bool,
    n: int,
) -> None:
    comm = world()
    t = _data(comm.rank, n, dtype)
    op = dist.ReduceOp.AVG if average else dist.ReduceOp.SUM
    work = dist.all_reduce(t, op=op, group=groups["mpx"], async_op=True)
    assert isinstance(work, MPXWork)
    pieces = len(work._handles)
    work.wait()
    expected = sum(_data(r, n, dtype) for r in range(comm.size))
    assert isinstance(expected, torch.Tensor)
    if average:
        expected = expected / comm.size
    torch.testing.assert_close(t, expected, rtol=0, atol=0)
    assert pieces == _pieces_expected(n * t.element_size())


def test_ops_the_flag_kernel_declines_stay_whole(
    groups: dict[str, dist.ProcessGroup], small_flag_bytes: int
) -> None:
    """MAX is not a flag-kernel op: one call, as before, and the right maximum."""
    comm = world()
    n = 50_000
    t = _data(comm.rank, n, torch.float32)
    work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=groups["mpx"], async_op=True)
    assert isinstance(work, MPXWork)
    assert len(work._handles) == 1
    work.wait()
    expected = torch.stack([_data(r, n, torch.float32) for r in range(comm.size)]).amax(0)
    torch.testing.assert_close(t, expected, rtol=0, atol=0)


def test_ddp_on_mpx_matches_gloo_with_buckets_in_pieces(
    groups: dict[str, dist.ProcessGroup], small_flag_bytes: int
) -> None:
    """DDP's gradients over buckets cut in pieces equal those of DDP on gloo."""
    comm = world()

    def grads(group: dist.ProcessGroup) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        g = torch.Generator().manual_seed(comm.rank)
        ddp(torch.randn(8, 256, generator=g)).sum().backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    on_gloo = grads(groups["gloo"])
    on_mpx = grads(groups["mpx"])
    assert len(on_mpx) == len(on_gloo) == 4
    for a, b in zip(on_mpx, on_gloo, strict=True):
        torch.testing.assert_close(a, b)
