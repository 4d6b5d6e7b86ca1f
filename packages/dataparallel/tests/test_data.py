"""DistributedDataContainer: shards are disjoint, cover the data set, agree on length."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from mpi4py import MPI

import mpx.dataparallel as dp
from mpx.dataparallel import fluxmpi


def _shards(n: int, size: int, **kwargs: Any) -> list[list[int]]:
    """Every rank's shard, built without MPI (a stand-in communicator per rank)."""
    data = list(range(n))
    return [
        dp.DistributedDataContainer(data, comm=SimpleNamespace(rank=r, size=size), **kwargs).indices  # type: ignore[arg-type]
        for r in range(size)
    ]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 10, 12, 101])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [False, True])
def test_keep_is_an_exact_partition(n: int, size: int, shuffle: bool) -> None:
    shards = _shards(n, size, shuffle=shuffle, uneven="keep")
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(n))  # disjoint, and the union is everything
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


@pytest.mark.parametrize("n", [1, 2, 7, 10, 12, 101])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_pad_and_drop_give_equal_lengths(n: int, size: int) -> None:
    padded = _shards(n, size, shuffle=True, seed=3, uneven="pad")
    assert len({len(s) for s in padded}) == 1
    assert set().union(*map(set, padded)) == set(range(n))
    assert sum(map(len, padded)) - n == (-n) % size  # only the padding repeats
    if n >= size:
        dropped = _shards(n, size, shuffle=True, seed=3, uneven="drop")
        flat = [i for s in dropped for i in s]
        assert len({len(s) for s in dropped}) == 1
        assert len(flat) == len(set(flat)) == n - n % size


def _comm(rank: int, size: int) -> Any:
    """A stand-in communicator (the split reads only rank and size)."""
    return SimpleNamespace(rank=rank, size=size)


@pytest.mark.parametrize("n", [0, 1, 5, 10, 11, 101])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_ceil_is_fluxmpis_split(n: int, size: int) -> None:
    # FluxMPI: Iterators.partition(1:N, ceil(N / size)), block r on rank r (none past the end)
    per = -(-n // size)
    blocks = [list(range(n))[i : i + per] for i in range(0, n, per)] if n else []
    expected = [blocks[r] if r < len(blocks) else [] for r in range(size)]
    assert _shards(n, size, uneven="ceil") == expected
    flux = [
        fluxmpi.DistributedDataContainer(list(range(n)), comm=_comm(r, size)).indices
        for r in range(size)
    ]
    assert flux == expected


def test_fluxmpis_eleven_samples_on_two_ranks_are_disjoint() -> None:
    flux = [fluxmpi.DistributedDataContainer(list(range(11)), comm=_comm(r, 2)) for r in range(2)]
    assert [len(f) for f in flux] == [6, 5]
    assert sorted(x for f in flux for x in f) == list(range(11))  # none seen twice


def test_divisible_modes_agree_and_contiguous() -> None:
    for mode in ("pad", "drop", "keep", "ceil"):
        assert _shards(12, 3, uneven=mode) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_set_epoch_reshuffles_deterministically() -> None:
    comm = SimpleNamespace(rank=0, size=2)
    a = dp.DistributedDataContainer(list(range(50)), shuffle=True, seed=5, comm=comm)  # type: ignore[arg-type]
    b = dp.DistributedDataContainer(list(range(50)), shuffle=True, seed=5, comm=comm)  # type: ignore[arg-type]
    first = a.indices
    a.set_epoch(1)
    assert a.indices != first
    b.set_epoch(1)
    assert a.indices == b.indices


def test_indexing_datasets_and_tuples() -> None:
    x, y = torch.arange(10).float(), torch.arange(10) * 2
    comm = SimpleNamespace(rank=1, size=2)
    part = dp.DistributedDataContainer((x, y), comm=comm)  # type: ignore[arg-type]
    assert len(part) == 5
    assert part[0] == (x[5], y[5])
    tds = dp.DistributedDataContainer(torch.utils.data.TensorDataset(x, y), comm=comm)  # type: ignore[arg-type]
    loader = torch.utils.data.DataLoader(tds, batch_size=5)
    (bx, by) = next(iter(loader))
    assert torch.equal(bx, x[5:])
    assert torch.equal(by, y[5:])
    with pytest.raises(IndexError, match="out of range"):
        part[5]


def test_bad_arguments() -> None:
    with pytest.raises(
        ValueError, match="uneven must be one of pad, drop, keep, ceil, got 'spread'"
    ):
        dp.DistributedDataContainer([1, 2], uneven="spread")
    with pytest.raises(TypeError, match="needs a data set with len"):
        dp.DistributedDataContainer(5)
    with pytest.raises(ValueError, match="one length"):
        dp.DistributedDataContainer((torch.zeros(3), torch.zeros(4)))
    with pytest.raises(ValueError, match="non-negative"):
        dp.DistributedDataContainer([1]).set_epoch(-1)
    comm = SimpleNamespace(rank=0, size=3)
    with pytest.raises(ValueError, match="leaves every rank empty"):
        dp.DistributedDataContainer([1, 2], uneven="drop", comm=comm)  # type: ignore[arg-type]


@pytest.mark.mpi
@pytest.mark.parametrize("uneven", ["pad", "drop", "keep", "ceil"])
def test_real_ranks_partition_the_data(uneven: str) -> None:
    n = 23
    part = dp.DistributedDataContainer(list(range(n)), shuffle=True, seed=1, uneven=uneven)
    part.set_epoch(2)
    every = MPI.COMM_WORLD.allgather(part.indices)
    flat = [i for s in every for i in s]
    size = dp.world_size()
    if uneven in ("keep", "ceil"):
        assert sorted(flat) == list(range(n))
    else:
        assert len({len(s) for s in every}) == 1
        if uneven == "pad":
            assert set(flat) == set(range(n))
        else:
            assert len(set(flat)) == len(flat) == n - n % size
