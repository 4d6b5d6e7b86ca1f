"""The hierarchical implementation, on nodes simulated with ``MPX_RANKS_PER_NODE``.

Under mpxrun -n 1/2/3 the simulated layouts are: 1 rank per node (no
hierarchy: auto runs the ring), 2 per node (3 ranks: nodes of 2 and 1, the
leaders fallback). The lanes algorithm (equal nodes) needs 4 ranks: a unit
test starts that job itself (2 nodes x 2 ranks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpx.collectives import Communicator, allreduce, broadcast
from mpx.collectives.core.policy import choose
from mpx.launch.settings import reload
from mpx.launch.virtual_cluster import VirtualCluster

JOB = Path(__file__).with_name("hier_job.py")


@pytest.fixture
def simulated(request: pytest.FixtureRequest) -> Iterator[Communicator]:
    # reload(): the settings are read once and cached (the root conftest has read them
    # already under mpxrun); without it no node was simulated and hier never ran here.
    os.environ["MPX_RANKS_PER_NODE"] = str(request.param)
    reload()
    try:
        comm = Communicator.from_mpi(MPI.COMM_WORLD)
    finally:
        del os.environ["MPX_RANKS_PER_NODE"]
        reload()
    # The layout asked for, so that a cached setting cannot pass for it again.
    assert comm.node_size == min(
        request.param, comm.size - (comm.rank // request.param) * request.param
    )
    yield comm
    comm.free()


def _inputs(size: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [
        torch.from_numpy(np.random.default_rng([r, n]).normal(size=n)).to(dtype)
        for r in range(size)
    ]


@pytest.mark.mpi
@pytest.mark.parametrize("simulated", [1, 2], indirect=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n", [1, 1000, (1 << 20) + 3])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_allreduce_across_simulated_nodes(
    simulated: Communicator, dtype: torch.dtype, n: int, op: str
) -> None:
    comm = simulated
    inputs = _inputs(comm.size, n, dtype)
    t = inputs[comm.rank].clone()
    impl = "hier"
    if comm.hierarchy is None:  # the same on every rank: the layout is the job's
        with pytest.raises(ValueError, match="impl='hier'"):
            allreduce(t, op, comm=comm, impl="hier")
        assert choose("allreduce", False, t.nbytes, comm) in ("mpi", "shm", "ring")
        impl = "auto"  # what runs on this layout instead, checked the same way
    allreduce(t, op, comm=comm, impl=impl)
    stacked = np.stack([x.double().numpy() for x in inputs])
    want = {"sum": stacked.sum(0), "avg": stacked.mean(0), "max": stacked.max(0)}[op]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2}[dtype]
    np.testing.assert_allclose(t.double().numpy(), want, rtol=tol, atol=tol)


@pytest.mark.mpi
@pytest.mark.parametrize("simulated", [1, 2], indirect=True)
def test_broadcast_and_auto_across_simulated_nodes(simulated: Communicator) -> None:
    comm = simulated
    for root in range(comm.size):
        t = torch.arange(300_000, dtype=torch.float32) * (comm.rank + 1)
        broadcast(t, root, comm=comm)  # auto
        torch.testing.assert_close(t, torch.arange(300_000, dtype=torch.float32) * (root + 1))
    if comm.num_nodes > 1:
        with pytest.raises(ValueError, match="spans"):
            allreduce(torch.ones(10), comm=comm, impl="shm")
        big = torch.ones(1 << 18)
        name = choose("allreduce", False, big.nbytes, comm)
        assert name == ("hier" if comm.hierarchy is not None else "ring")
        allreduce(big, comm=comm)
        assert float(big[-1]) == comm.size


@pytest.mark.parametrize(
    "where",
    [
        "simulated",
        pytest.param(
            "virtual",
            marks=pytest.mark.skipif(
                not VirtualCluster.supported(), reason="virtual nodes need root and iproute2"
            ),
        ),
    ],
)
def test_lanes_on_two_nodes_of_two_ranks(where: str) -> None:
    """Equal nodes: the lanes algorithm, checked against numpy inside a 4-rank job.

    ``simulated``: MPX_RANKS_PER_NODE=2 on one node. ``virtual``: two network
    namespaces (``mpxrun --virtual-nodes 2``), so MPI itself sees two hosts and
    the cross-node traffic is TCP over veth links.
    """
    env = {**os.environ, "MPX_TIMEOUT": "120"}
    placement = ["--virtual-nodes", "2"] if where == "virtual" else []
    if where == "simulated":
        env["MPX_RANKS_PER_NODE"] = "2"
    command = [sys.executable, "-m", "mpx.launch", *placement, "-n", "4", "--timeout", "240"]
    result = subprocess.run(
        [*command, "--", sys.executable, str(JOB)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "hier job ok: 2 nodes x 2 ranks, lanes" in result.stdout
