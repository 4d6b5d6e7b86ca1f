"""impl="gloo" (torch's ProcessGroupGloo over the communicator's ranks) against MPI's results.

TorchMPI offered NCCL and Gloo collectives beside its own; here they are
implementations to name per call. Run under mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import allgather, allreduce, alltoall, broadcast, reduce, reduce_scatter, world
from mpx.collectives.core.policy import PolicyError, choose

pytestmark = pytest.mark.mpi


def _mine(n: int = 12, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    r = world().rank
    return (torch.arange(n, dtype=torch.float64) * (r + 1) + r).to(dtype)


@pytest.mark.parametrize("op", ["sum", "avg", "max", "min", "prod"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64])
def test_gloo_allreduce_equals_mpi(op: str, dtype: torch.dtype) -> None:
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg needs a floating dtype")
    got, want = _mine(dtype=dtype), _mine(dtype=dtype)
    allreduce(got, op, impl="gloo", timeout=60)
    allreduce(want, op, impl="mpi", timeout=60)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_gloo_runs_the_other_collectives_like_mpi() -> None:
    comm = world()
    for root in range(comm.size):
        got, want = _mine(), _mine()
        broadcast(got, root, impl="gloo", timeout=60)
        broadcast(want, root, impl="mpi", timeout=60)
        assert torch.equal(got, want)
        got, want = _mine(), _mine()
        reduce(got, root, "sum", impl="gloo", timeout=60)
        reduce(want, root, "sum", impl="mpi", timeout=60)
        if comm.rank == root:
            assert torch.equal(got, want)
        else:  # reduce's contract: the other ranks' tensors are unchanged
            assert torch.equal(got, _mine()), (root, got)
    assert torch.equal(allgather(_mine(), impl="gloo"), allgather(_mine(), impl="mpi"))
    rows = _mine(4 * comm.size).reshape(comm.size, 4)
    assert torch.equal(alltoall(rows.clone(), impl="gloo"), alltoall(rows.clone(), impl="mpi"))
    # an op gloo does not run here falls back to MPI, same result
    block = reduce_scatter(rows.clone(), impl="gloo")
    assert torch.equal(block, reduce_scatter(rows.clone(), impl="mpi"))


def test_gloo_and_nccl_are_never_chosen_by_auto_and_nccl_takes_cuda_only() -> None:
    comm = world()
    for nbytes in (4, 1 << 20, 1 << 28):
        assert choose("allreduce", False, nbytes, comm) not in ("gloo", "nccl")
    assert choose("reduce_scatter", False, 64, comm, "gloo") == "mpi"
    with pytest.raises(PolicyError, match="impl='nccl' takes CUDA tensors, got a CPU one"):
        allreduce(torch.ones(4), impl="nccl")


@pytest.mark.gpu
def test_nccl_allreduce_equals_staged_on_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if torch.cuda.device_count() < world().node_size:
        # NCCL refuses two ranks on one device ("Duplicate GPU detected").
        pytest.skip(f"NCCL needs a GPU per rank: {world().node_size} ranks share "
                    f"{torch.cuda.device_count()} GPU(s) on this node")  # fmt: skip
    got, want = _mine().cuda(), _mine().cuda()
    allreduce(got, "sum", impl="nccl", timeout=120)
    allreduce(want, "sum", impl="staged", timeout=120)
    torch.testing.assert_close(got, want)
