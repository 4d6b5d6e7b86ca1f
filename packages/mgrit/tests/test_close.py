"""close(): the communicators an mgrit object splits off are freed, collectively, once.

MPICH gives a process about 2000 communicators, and every LayerParallel (and every
grid of a ParallelGRU) splits one off for its adjoint: without close() a process
that built a few hundred networks stopped with "Too many communicators".
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpx.collectives import Communicator, world
from mpx.mgrit import LayerParallel, MGRITConfigError, ParallelGRU

pytestmark = pytest.mark.mpi

#: More networks than MPICH's communicators allow a process without close() (each
#: split Communicator holds several MPI communicators; ~400 exhaust them at 1 rank).
MANY = 480


def small(comm: Communicator | MPI.Intracomm | None = None, steps: int = 4) -> LayerParallel:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(3, 3), nn.Tanh()) for _ in range(steps)]
    net = LayerParallel(nn.Linear(2, 3), layers, nn.Linear(3, 1), steps, comm=comm, levels=2)
    return net.double()


def batch() -> torch.Tensor:
    return torch.randn(4, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))


def freed(comm: Communicator) -> bool:
    """Whether MPI freed ``comm``'s communicator (mpi4py sets a freed handle to null)."""
    return comm.mpi == MPI.COMM_NULL


def test_close_frees_the_adjoint_communicator_and_use_raises() -> None:
    net = small()
    loss = net(batch()).sum()  # a graph made before close(): its backward must refuse
    made = net.stepper.rcomm
    assert not freed(made)
    net.close()
    assert freed(made)
    assert net.stepper.closed
    with pytest.raises(MGRITConfigError, match=r"LayerParallel was closed: close\(\) freed"):
        net(batch())
    with pytest.raises(MGRITConfigError, match=r"close\(\)"):
        loss.backward()
    with pytest.raises(MGRITConfigError, match=r"LayerParallel was closed"):
        net.serial()
    net.close()  # a second close does nothing
    assert net.state_dict().keys() == small().state_dict().keys()  # the layers stay
    # The communicator the network ran on is the caller's: still whole.
    assert not freed(net.comm)
    assert net.comm.allgather_object(net.comm.rank) == list(range(net.comm.size))


def test_a_communicator_the_user_passed_is_never_freed() -> None:
    mine = world().split(0, key=world().size - 1 - world().rank)
    assert mine is not None
    for comm in (mine, MPI.COMM_WORLD):
        net = small(comm)
        net(batch()).sum().backward()
        net.close()
        assert freed(net.stepper.rcomm)
        assert not freed(net.comm)
        assert net.comm.allgather_object(1) == [1] * net.comm.size
    # Networks on the same communicator after a close() run as before.
    small(mine).close()
    again, other = small(mine), small(mine)
    assert torch.equal(again(batch()), other(batch()))
    again.close()
    other.close()
    mine.free()


def test_building_and_closing_more_networks_than_mpi_allows() -> None:
    start = time.perf_counter()
    for _ in range(MANY):
        net = LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 2, levels=1)
        net.close()
    elapsed = time.perf_counter() - start
    # Still able to make communicators, and run a network, after all of them.
    net = small()
    y = net(batch())
    assert torch.isfinite(y).all()
    net.close()
    assert elapsed < 120, f"{MANY} networks took {elapsed:.0f} s"


def test_a_constructor_that_fails_frees_what_it_made(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Communicator] = []
    split = Communicator.split

    def recording(self: Communicator, color: int | None, key: int | None = None) -> Any:
        new = split(self, color, key)
        assert new is not None  # every rank is in the adjoint's communicator
        made.append(new)
        return new

    monkeypatch.setattr(Communicator, "split", recording)
    # Bad step layers are found after the adjoint's split: the error frees it again.
    with pytest.raises(MGRITConfigError, match="3 modules but num_steps=2"):
        LayerParallel(nn.Identity(), [nn.Linear(2, 2)] * 3, nn.Identity(), 2, levels=1)
    assert len(made) == 1
    assert all(freed(c) for c in made)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_the_gru_frees_every_grid_it_built(bidirectional: bool) -> None:
    gru = ParallelGRU(2, 3, bidirectional=bidirectional, levels=2, cfactor=2)
    for length in (8, 5):  # two lengths: two grids
        gru(torch.randn(length, 1, 2, generator=torch.Generator().manual_seed(length)))
    made = [d.stepper.rcomm for grid in gru._grids.values() for d in grid]
    assert len(made) == (4 if bidirectional else 2)
    assert not any(freed(c) for c in made)
    gru.close()
    assert all(freed(c) for c in made)
    with pytest.raises(MGRITConfigError, match=r"ParallelGRU was closed: close\(\) freed"):
        gru(torch.zeros(8, 1, 2))
    gru.close()
    assert not freed(gru.comm)
