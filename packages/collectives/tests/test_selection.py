"""``auto`` and the refusals of ``choose``: device, size, topology."""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import allreduce, world
from mpx.collectives.core.policy import choose, small_bytes
from mpx.launch.settings import reload as reload_settings

pytestmark = pytest.mark.mpi


def test_auto_by_size_on_one_node() -> None:
    comm = world()
    small, large = small_bytes() - 4, small_bytes()
    assert choose("allreduce", False, small, comm) == "mpi"
    want = "mpi" if comm.size == 1 else ("shm" if comm.single_node else "hier")
    assert choose("allreduce", False, large, comm) == want
    # shm has no alltoall: it falls back to MPI's.
    assert choose("alltoall", False, large, comm, "shm") == "mpi"


def test_environment_variable_selects(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "ring")
    reload_settings()
    assert choose("allreduce", False, 12, world()) == "ring"
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "fastest")
    reload_settings()
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
