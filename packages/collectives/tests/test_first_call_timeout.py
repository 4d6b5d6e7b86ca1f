"""The first ``shm`` call of a communicator honours its timeout.

That call creates the shared windows (``MPI.Win.Allocate_shared``), which
blocks until every rank has called it: without the arrival barrier in front
of it, a peer that never comes hung the call forever, ``timeout=`` and
``MPX_TIMEOUT`` notwithstanding.
"""

from __future__ import annotations

import time

import pytest
import torch
from mpi4py import MPI

from mpx.collectives import CollectiveTimeout, Communicator, allgather, allreduce, broadcast
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi

_TIMEOUT_S = 2.0
_LARGE = 1 << 18  # 1 MiB of float32: auto runs shm on one node


def _call(op: str, t: torch.Tensor, comm: Communicator, timeout: float | None) -> torch.Tensor:
    if op == "allreduce":  # auto: shm by size, as a user's gradient allreduce
        return allreduce(t, comm=comm, timeout=timeout)
    if op == "broadcast":
        return broadcast(t, 0, comm=comm, impl="shm", timeout=timeout)
    return allgather(t, comm=comm, impl="shm", timeout=timeout)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["allreduce", "broadcast", "allgather"])
@pytest.mark.parametrize("given", ["timeout=", "communicator timeout (MPX_TIMEOUT)"])
def test_first_shm_call_times_out_when_peers_never_arrive(
    op: str, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 calls alone; the others wait elsewhere (a barrier rank 0 joins later).

    Under MPX_CHECK=0: with the default check, the comparison of the call's new
    signature is what waits first (and times out alike, as test_consistency
    shows); here the shm arrival barrier itself must time out.
    """
    monkeypatch.setenv("MPX_CHECK", "0")
    reload_settings()
    per_comm = _TIMEOUT_S if given.startswith("communicator") else None
    per_call = None if per_comm is not None else _TIMEOUT_S
    # A new communicator: no workspace yet, so this is its first shm call.
    comm = Communicator.from_mpi(MPI.COMM_WORLD, timeout=per_comm)
    t = torch.ones(_LARGE)
    try:
        if comm.size == 1:  # nobody to wait for: it just works
            out = _call(op, t, comm, per_call)
            assert out.eq(1).all()
            return
        if comm.rank == 0:
            start = time.monotonic()
            with pytest.raises(CollectiveTimeout) as info:
                _call(op, t, comm, per_call)
            took = time.monotonic() - start
            assert took < _TIMEOUT_S + 3.0, f"raised after {took:.1f} s"
            assert info.value.op == op, info.value.op
            assert info.value.seconds == _TIMEOUT_S
            assert info.value.peers == list(range(1, comm.size))
            message = str(info.value)
            assert message.startswith(op), message
            assert f"within {_TIMEOUT_S:g} s" in message, message
            assert f"rank(s) {', '.join(map(str, range(1, comm.size)))}" in message, message
    finally:
        MPI.COMM_WORLD.Barrier()  # the others wait here: they never arrive at the call
        if comm.size > 1 and comm.rank != 0:
            # Match rank 0's arrival barrier, so that nothing stays in flight.
            comm.mpi.Ibarrier().Wait()
        MPI.COMM_WORLD.Barrier()
        monkeypatch.delenv("MPX_CHECK")
        reload_settings()
