"""``auto`` and the refusals of ``choose``: device, size, topology."""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import allreduce, world
from mpx.collectives.selection import choose
from mpx.collectives.thresholds import small_bytes

pytestmark = pytest.mark.mpi


def test_auto_by_size_on_one_node() -> None:
    comm = world()
    small = torch.ones(small_bytes() // 4 - 1)
    large = torch.ones(small_bytes() // 4)
    assert choose("allreduce", small, comm, None)[0] == "mpi"
    want = "mpi" if comm.size == 1 else ("shm" if comm.single_node else "hier")
    assert choose("allreduce", large, comm, None)[0] == want
    # shm has no alltoall: it falls back to MPI's.
    assert choose("alltoall", large, comm, "shm")[0] == "mpi"


def test_environment_variable_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "ring")
    assert choose("allreduce", torch.ones(3), world(), None)[0] == "ring"
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        allreduce(torch.ones(3))


@pytest.mark.parametrize("impl", ["staged", "ipc"])
def test_cuda_implementations_refuse_cpu_tensors(impl: str) -> None:
    with pytest.raises(ValueError, match=f"impl='{impl}' takes CUDA tensors"):
        allreduce(torch.ones(4), impl=impl)


def test_hier_on_one_node_is_refused() -> None:
    comm = world()
    if comm.hierarchy is not None:
        pytest.skip("this job spans several nodes")
    with pytest.raises(ValueError, match="impl='hier'"):
        allreduce(torch.ones(4), impl="hier")
