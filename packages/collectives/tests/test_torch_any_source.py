"""torch's receive from any source on the "mpx" group: the registry's recv runs it."""

from typing import Any

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives import world

pytestmark = pytest.mark.mpi


def test_recv_from_any_source_runs_the_registrys_recv_and_names_the_sender(
    groups: dict[str, dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dist.recv(t)`` (no source) is the policy's recv implementation, as every receive.

    It posted its own MPI receive beside mpx's (no timeout handling, no
    staging of CUDA tensors, a wait of its own); now the registry's op
    function runs it, with ``MPI.ANY_SOURCE``, and the work still names the
    rank whose message arrived.
    """
    from mpx.collectives.core import registry
    from mpx.collectives.impl import mpi as impl_mpi

    sources: list[int] = []
    original = impl_mpi.recv

    def counted(comm: Any, t: torch.Tensor, source: int, tag: int) -> Any:
        sources.append(source)
        return original(comm, t, source, tag)

    monkeypatch.setattr(impl_mpi, "recv", counted)
    monkeypatch.setattr(registry, "_functions", {})  # looked up again: the counting one
    comm = world()
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    group: Any = groups["mpx"]
    # The group's own methods: torch refuses a send to oneself, which one rank needs.
    sent = group.send([torch.full((3,), float(comm.rank))], right, 7)
    got = torch.zeros(3)
    work = group.recv_anysource([got], 7)
    work.wait()
    sent.wait()
    assert sources == [MPI.ANY_SOURCE]
    assert got.tolist() == [float(left)] * 3
    assert work._source_rank() == left
    if comm.size > 1:  # and through torch's API, which returns the source
        if comm.rank == 0:
            dist.send(torch.tensor([5.0]), 1, group=groups["mpx"])
        elif comm.rank == 1:
            one = torch.zeros(1)
            assert dist.recv(one, group=groups["mpx"]) == 0
            assert one.item() == 5.0
            assert len(sources) == 2
