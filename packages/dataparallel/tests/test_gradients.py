"""allreduce_gradients, init(gpu_devices=...) and FluxMPI's names (run under mpxrun -n 1, 2, 3)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import mpx.dataparallel as dp
from mpx.dataparallel import fluxmpi

pytestmark = pytest.mark.mpi


def _grads_of_rank(r: int, model: nn.Module) -> list[torch.Tensor | None]:
    """Rank r's gradients: known to every rank, so each can compute the mean itself."""
    g = torch.Generator().manual_seed(100 + r)
    out: list[torch.Tensor | None] = []
    for i, p in enumerate(model.parameters()):
        out.append(None if i == 1 and r == 0 else torch.randn(p.shape, generator=g, dtype=p.dtype))
    return out


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2).double())


@pytest.mark.parametrize("average", [True, False])
def test_allreduce_gradients_averages_like_numpy(average: bool) -> None:
    size = dp.world_size()
    model = _model()
    for p, g in zip(model.parameters(), _grads_of_rank(dp.rank(), model), strict=True):
        p.grad = g
    dp.allreduce_gradients(model, average=average)
    every = [_grads_of_rank(r, model) for r in range(size)]
    for i, p in enumerate(model.parameters()):
        # a missing gradient counts as zeros (rank 0 has none for parameter 1)
        parts = [torch.zeros_like(p) if g[i] is None else g[i] for g in every]
        want = torch.stack([t.double() for t in parts if t is not None]).sum(0)
        if average:
            want = want / size
        assert p.grad is not None
        torch.testing.assert_close(p.grad.double(), want, rtol=1e-6, atol=1e-6)


def test_allreduce_gradients_rejects_what_is_not_a_model() -> None:
    with pytest.raises(
        TypeError, match=r"allreduce_gradients takes an nn\.Module or its parameters"
    ):
        dp.allreduce_gradients(3)  # type: ignore[arg-type]


def test_init_gpu_devices_names_the_bad_device() -> None:
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=rf"gpu_devices=\[{count}\] must list CUDA devices"):
        dp.init(gpu_devices=[count])
    if count:
        dp.init(gpu_devices=[0])
        assert torch.cuda.current_device() == 0


def test_fluxmpi_local_rank_is_the_world_rank() -> None:
    """FluxMPI's local_rank() is the world rank; mpx's own is torch's node-local one."""
    fluxmpi.Init()
    assert fluxmpi.local_rank() == dp.rank()
    assert dp.local_rank() == dp.init().node_rank
    assert fluxmpi.total_workers() == dp.world_size()
    if os.environ.get("MPX_RANKS_PER_NODE") is None and dp.world_size() > 1:
        assert dp.local_rank() == dp.rank()  # one node here: they only differ across nodes
    model = fluxmpi.synchronize(_model())
    opt = fluxmpi.DistributedOptimiser(torch.optim.SGD(model.parameters(), lr=0.1), model)
    assert isinstance(opt, dp.DistributedOptimizer)
    opt.remove_hooks()


def test_fluxmpi_println_prefixes_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    fluxmpi.fluxmpi_println("hello", 3)
    assert capsys.readouterr().out == f"[{dp.rank()} / {dp.world_size()}] hello 3\n"
