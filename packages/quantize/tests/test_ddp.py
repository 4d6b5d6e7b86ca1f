"""The DDP communication hook on gloo and on the mpx backend, training on digits."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn

import mpx.quantize as mq
from mpx.collectives import init_process_group, world
from mpx.launch import init_torch_env
from mpx.quantize.reduction.config import registry

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[str, dist.ProcessGroup]]:
    init_torch_env()
    init_process_group("env://")
    gloo = dist.new_group(backend="gloo")
    default = dist.group.WORLD
    assert default is not None
    yield {"mpx": default, "gloo": gloo}
    dist.destroy_process_group()


def _digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    x, y = load_digits(return_X_y=True)
    perm = np.random.default_rng(0).permutation(len(y))
    x = torch.tensor(x[perm] / 16.0, dtype=torch.float32)
    y = torch.tensor(y[perm], dtype=torch.int64)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def _train(
    group: dist.ProcessGroup, state: mq.QuantizeState | None, epochs: int = 6
) -> tuple[nn.Module, float]:
    comm = world()
    xtr, ytr, xte, yte = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    if state is not None:
        state.names.update({id(p): n for n, p in model.named_parameters()})
        ddp.register_comm_hook(state, mq.ddp_comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    batch = 60  # global batch; each rank takes its share
    for _ in range(epochs):
        for start in range(0, len(ytr), batch):
            idx = torch.arange(start, min(start + batch, len(ytr)))
            mine = idx[comm.rank :: comm.size]
            opt.zero_grad()
            nn.functional.cross_entropy(ddp(xtr[mine]), ytr[mine]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(xte).argmax(1) == yte).float().mean().item()
    return model, accuracy


def _same_on_all_ranks(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy()
    everyone = world().mpi.allgather(flat)
    return all(np.array_equal(everyone[0], other) for other in everyone)


@pytest.mark.parametrize("backend", ["gloo", "mpx"])
def test_ddp_hook_at_4_bits_matches_fp32_accuracy(
    groups: dict[str, dist.ProcessGroup], backend: str
) -> None:
    comm = world()
    full, full_accuracy = _train(groups[backend], None)
    config = mq.CompressionConfig(bits=4, bucket_size=512)
    state = mq.QuantizeState(config, comm)
    compressed, accuracy = _train(groups[backend], state)
    assert _same_on_all_ranks(compressed)
    assert full_accuracy > 0.9
    assert accuracy >= full_accuracy - 0.01, (accuracy, full_accuracy)
    if comm.size > 1:
        # the weights went compressed, the biases (1-D) not: well under a quarter of fp32
        assert 0 < state.bytes_sent < 0.25 * state.bytes_uncompressed
        drift = max(
            (a - b).abs().max().item()
            for a, b in zip(compressed.parameters(), full.parameters(), strict=True)
        )
        assert 0 < drift < 0.5


def test_excluded_layers_train_in_full_precision(groups: dict[str, dist.ProcessGroup]) -> None:
    comm = world()
    config = mq.CompressionConfig(bits=32)  # everything uncompressed: equals plain DDP
    state = mq.QuantizeState(config, comm)
    hooked, _ = _train(groups["gloo"], state, epochs=1)
    plain, _ = _train(groups["gloo"], None, epochs=1)
    for a, b in zip(hooked.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    excluded = mq.QuantizeState(mq.CompressionConfig(bits=2, exclude=("0.", "2.")), comm)
    hooked, _ = _train(groups["gloo"], excluded, epochs=1)
    for a, b in zip(hooked.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert excluded.bytes_sent == excluded.bytes_uncompressed


def _one_step(group: dist.ProcessGroup, state: mq.QuantizeState | None) -> dict[str, torch.Tensor]:
    """Gradients of one DDP step on digits; the hook's state knows no parameter names."""
    comm = world()
    xtr, ytr, _, _ = _digits()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model, process_group=group)
    if state is not None:
        ddp.register_comm_hook(state, mq.ddp_comm_hook)
    mine = torch.arange(60)[comm.rank :: comm.size]
    nn.functional.cross_entropy(ddp(xtr[mine]), ytr[mine]).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_exclusion_without_names_raises_instead_of_being_ignored(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """CompressionConfig(exclude=...) without model= had no effect, silently."""
    state = mq.QuantizeState(mq.CompressionConfig(bits=2, exclude=("0.weight",)), world())
    with pytest.raises(Exception, match=r"excluded by name, but this gradient bucket's"):
        _one_step(groups["gloo"], state)


def test_cgx_register_model_pairs_exclude_layers_by_name(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """CGX's register_model([(name, numel), ...]) + exclude_layer: the names were never read."""
    shapes = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    registry.clear()
    try:
        mq.register_model([(n, p.numel()) for n, p in shapes.named_parameters()])
        mq.exclude_layer("0.weight")
        state = mq.QuantizeState(mq.CompressionConfig(bits=2), world())
        hooked = _one_step(groups["gloo"], state)
    finally:
        registry.clear()
    plain = _one_step(groups["gloo"], None)
    error = {n: float((hooked[n] - g).abs().max()) for n, g in plain.items()}
    for name in ("0.weight", "0.bias", "2.bias"):  # excluded by name, and 1-D
        assert error[name] < 1e-6, (name, error)
    if world().size > 1:
        assert error["2.weight"] > 1e-4, error  # 2 bits: compressed
        # 0.weight is 8192 of the 9610 values: it goes uncompressed, so most bytes do
        assert state.bytes_sent > 0.8 * state.bytes_uncompressed, (
            state.bytes_sent,
            state.bytes_uncompressed,
        )
