"""What both layer-parallel benchmarks measure the same way, besides their networks.

``bench_mgrit.py`` (the width-128 MLP step) and ``bench_mgrit_conv.py`` (the
convolutional step) each price the performance model with a message time and a
core contention measured inside their own job, and time the serial network on
rank 0 while the other ranks wait without taking a core. The benchmarks import
this module from their folder (the script's own, on the path).

Example::

    t_msg = message_seconds(comm, torch.zeros(128, 128))
    slow = contention(comm, lambda: step(x))
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

__all__ = ["contention", "message_seconds", "wait_politely"]


def wait_politely(comm: Any) -> None:
    """Waits for every rank sleeping, not polling MPI: while rank 0 times something
    alone, a polling rank would take a core from it on a loaded machine."""
    done = comm.mpi.Ibarrier()
    while not done.Test():
        time.sleep(0.002)


def message_seconds(comm: Any, buf: Any, rounds: int = 50) -> float:
    """One message of ``buf`` (a state) between ranks 0 and 1, one way: a ping-pong's
    half, the same on every rank (0.0 on one rank)."""
    from mpx.collectives import recv, send

    if comm.size < 2:
        return 0.0
    comm.mpi.Barrier()
    start = time.perf_counter()
    for _ in range(rounds):
        if comm.rank == 0:
            send(buf, 1, comm=comm)
            recv(buf, 1, comm=comm)
        elif comm.rank == 1:
            recv(buf, 0, comm=comm)
            send(buf, 0, comm=comm)
    return float(comm.mpi.bcast((time.perf_counter() - start) / (2 * rounds), root=0))


def contention(comm: Any, work: Callable[[], object], repeats: int = 9) -> float:
    """How much slower ``work`` runs with every rank running it than on rank 0 alone
    (other ranks and other jobs share the cores), at least 1, the same on every rank."""
    if comm.size == 1:
        return 1.0  # nothing shares the cores with rank 0 but other jobs

    def median(everyone: bool) -> float:
        samples = []
        for _ in range(repeats):
            comm.mpi.Barrier()
            start = time.perf_counter()
            if everyone or comm.rank == 0:
                work()
            samples.append(time.perf_counter() - start)
            wait_politely(comm)
        return statistics.median(samples)

    alone, shared = median(False), median(True)
    return float(comm.mpi.bcast(max(1.0, shared / alone), root=0))
