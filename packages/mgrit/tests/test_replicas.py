"""split_replicas: R replicas of a P-rank LayerParallel equal one process on the whole batch.

Every factorization R x P of the world size is tried (at 2 ranks: 2 x 1 and 1 x 2).
The gradients are averaged with mpx-collectives' allreduce here, as the README's
recipe does with mpx-dataparallel's DistributedOptimizer (tested in the repository's
tests/test_layer_parallel_replicas.py: mpx-mgrit does not depend on mpx-dataparallel).
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from mpx.collectives import Communicator, allreduce, world
from mpx.mgrit import LayerParallel, MGRITConfigError, ReplicaGroups, split_replicas

pytestmark = pytest.mark.mpi

BATCH, STEPS, LR = 12, 8, 0.5  # 12 samples: equal shards for 1, 2, 3 or 4 replicas


def layer_sizes() -> list[int]:
    size = world().size
    return [p for p in range(1, size + 1) if size % p == 0]


def build(comm: Communicator) -> LayerParallel:
    torch.manual_seed(0)  # every rank builds the same layers
    return LayerParallel(
        nn.Linear(4, 6), lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3),
        STEPS, Tf=2.0, comm=comm, levels=2, cfactor=2, fwd_iters=STEPS, bwd_iters=STEPS, tol=0.0,
    ).double()  # fmt: skip


def data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 4, dtype=torch.float64, generator=gen)
    return x, torch.randint(0, 3, (BATCH,), generator=gen)


@pytest.mark.parametrize("layer_size", layer_sizes())
def test_groups_are_consecutive_layer_ranks_and_their_replicas(layer_size: int) -> None:
    comm = world()
    groups = split_replicas(layer_size)
    try:
        assert isinstance(groups, ReplicaGroups)
        layer, replica = groups  # unpacks as a tuple
        assert (layer.size, replica.size) == (layer_size, comm.size // layer_size)
        assert (replica.rank, layer.rank) == divmod(comm.rank, layer_size)
        # The members of a replica group hold the same steps.
        net = build(groups.layer)
        owned = replica.allgather_object(list(net.owned_steps()))
        assert all(o == owned[0] for o in owned), owned
        everyone = layer.allgather_object(list(net.owned_steps()))
        assert sorted(k for part in everyone for k in part) == list(range(STEPS))
        net.close()
    finally:
        groups.free()


@pytest.mark.parametrize("layer_size", layer_sizes())
def test_replicas_on_shards_equal_one_process_on_the_whole_batch(layer_size: int) -> None:
    comm = world()
    groups = split_replicas(layer_size, comm)
    net = build(groups.layer)
    serial = net.serial()  # the same weights, one process
    x, y = data()
    r, replicas = groups.replica.rank, groups.replica.size
    shard = slice(r * BATCH // replicas, (r + 1) * BATCH // replicas)
    nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
    # Steps: averaged over their replicas. Open and close layers (on every rank):
    # over the whole job, so that every rank gets the same bits (see the README).
    for p in net.local_steps.parameters():
        assert p.grad is not None
        allreduce(p.grad, "avg", comm=groups.replica)
    for p in [*net.open_layer.parameters(), *net.close_layer.parameters()]:
        assert p.grad is not None
        allreduce(p.grad, "avg", comm=comm)
    torch.optim.SGD(net.parameters(), lr=LR).step()
    nn.functional.cross_entropy(serial(x), y).backward()
    torch.optim.SGD(serial.parameters(), lr=LR).step()
    got, want = net.serial().state_dict(), serial.state_dict()
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=1e-12, msg=name)
    start = build(groups.layer).serial().state_dict()
    moved = max((want[name] - start[name]).abs().max().item() for name in want)
    assert moved > 1e-3  # the step changed the weights: not a comparison of the start
    shared = torch.cat([p.detach().flatten() for p in net.open_layer.parameters()])
    assert all(torch.equal(s, shared) for s in comm.allgather_object(shared))
    net.close()
    groups.free()


def test_a_layer_size_that_does_not_divide_the_ranks_names_the_ones_that_do() -> None:
    size = world().size
    with pytest.raises(MGRITConfigError) as info:
        split_replicas(size + 1)
    message = str(info.value)
    assert f"layer_size={size + 1}" in message
    assert f"{size} ranks" in message
    assert str(layer_sizes()) in message


@pytest.mark.parametrize("bad", [0, -2, True, 1.5, "2"])
def test_a_layer_size_that_is_no_positive_int_is_refused(bad: object) -> None:
    expected = f"layer_size must be an int >= 1.*got {re.escape(repr(bad))}"
    with pytest.raises(MGRITConfigError, match=expected):
        split_replicas(bad)  # type: ignore[arg-type]
