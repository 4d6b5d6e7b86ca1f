"""CGX's cifar example's distributed part on mpx: DDP on "cgx" with cgx_utils' hook (issue 44).

As CGX's ``examples/cifar_train.py`` does it (written here, none of its code):
rank and size from Open MPI's variables, ``init_process_group("cgx")``, DDP,
``CGXState(dist.group.WORLD, compression_params={"bits": ..., "bucket_size":
...})`` and ``register_comm_hook(state, cgx_hook)``; a small conv net on random
data instead of CIFAR.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch_cgx
from torch.nn.parallel import DistributedDataParallel

from mpx.quantize.errors import QuantizeValueError

BITS = 4
LAYER_MIN_SIZE = 128


class _ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)  # weight 216: quantized
        self.bn = torch.nn.BatchNorm2d(8)  # 8 + 8, one dimension: exact
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1)  # weight 1152: quantized
        self.fc = torch.nn.Linear(16, 10)  # weight 160: quantized; bias 10: exact
        self.fc0 = torch.nn.Linear(10, 10)  # weight 100 < LAYER_MIN_SIZE: exact

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.relu(self.conv2(x)).mean((2, 3))
        out: torch.Tensor = self.fc0(torch.relu(self.fc(x)))
        return out


def _quantized(name: str, p: torch.Tensor) -> bool:
    return p.dim() > 1 and p.numel() >= LAYER_MIN_SIZE


@pytest.fixture(scope="module")
def cgx_world() -> Iterator[tuple[int, int]]:
    """CGX's example's setup: the default group on "cgx" from OMPI_COMM_WORLD_*."""
    assert "OMPI_COMM_WORLD_SIZE" in os.environ, "CGX only works with mpirun launch"
    rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]
    saved = {
        name: os.environ.pop(name, None)
        for name in ("CGX_COMPRESSION_QUANTIZATION_BITS", "MPX_QUANTIZE_BITS")
    }
    dist.init_process_group(backend="cgx", init_method="env://")
    try:
        yield rank, dist.get_world_size()
    finally:
        torch_cgx.clear_layers()
        dist.barrier()
        dist.destroy_process_group()
        for name, value in saved.items():
            if value is not None:
                os.environ[name] = value


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.002])
def test_ddp_with_cgx_hook_gives_each_layer_its_bits(
    cgx_world: tuple[int, int], bucket_cap_mb: float
) -> None:
    """Until the hook registers the layers (step 2) all exact (no bits variable: 32);
    from then on the big weights within the 4-bit bound, the rest exact; every rank's
    model stays identical and the loss falls."""
    from cgx_utils import CGXState, cgx_hook

    rank, size = cgx_world
    torch_cgx.clear_layers()
    torch.manual_seed(0)
    net = _ConvNet()
    replica = copy.deepcopy(net)  # the same step without DDP: this rank's own gradients
    model = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb)
    state = CGXState(
        dist.group.WORLD,
        layer_min_size=LAYER_MIN_SIZE,
        compression_params={"bits": BITS, "bucket_size": 64},
    )
    model.register_comm_hook(state, cgx_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    images = torch.randn(8, 3, 8, 8, generator=data)
    labels = torch.randint(0, 10, (8,), generator=data)
    losses = []
    for step in range(8):
        optimizer.zero_grad()
        replica.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        torch.nn.functional.cross_entropy(replica(images), labels).backward()
        losses.append(loss.item())
        mine = torch.cat([p.grad.flatten() for p in replica.parameters()])  # type: ignore[union-attr]
        every = [torch.empty_like(mine) for _ in range(size)]
        dist.all_gather(every, mine)  # exact on "cgx"
        exact = torch.stack([g.double() / size for g in every]).sum(0)
        biggest = max(g.abs().max().item() for g in every) / size
        bound = ((size - 1) * 2 * biggest + 2 * size * biggest) / (2**BITS - 1) + 1e-6
        offset = 0
        for name, p in net.named_parameters():
            n = p.numel()
            want, got = exact[offset : offset + n], p.grad.flatten().double()  # type: ignore[union-attr]
            offset += n
            error = (got - want).norm().item() / max(want.norm().item(), 1e-30)
            if step < 2 or not _quantized(name, p):
                assert error <= 1e-6, (step, name, error)
            else:
                assert (got - want).abs().max().item() <= bound, (step, name)
                if size > 1:
                    assert error > 1e-4, (step, name, error)  # quantized, not exact
        optimizer.step()
        with torch.no_grad():  # the replica takes DDP's step: its next gradients compare
            for p, q in zip(net.parameters(), replica.parameters(), strict=True):
                q.copy_(p)
    assert state.step == 8
    assert losses[-1] < losses[0], losses
    flat = torch.cat([p.detach().flatten() for p in net.parameters()])
    every = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(every, flat)
    assert all(torch.equal(flat, other) for other in every)  # bit-identical on every rank


def test_cgx_state_takes_cgxs_defaults_and_refuses_bad_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from cgx_utils import CGXState

    for name in (
        "CGX_COMPRESSION_QUANTIZATION_BITS",
        "CGX_COMPRESSION_BUCKET_SIZE",
        "CGX_COMPRESSION_MINIMAL_SIZE",
        "MPX_QUANTIZE_BITS",
        "MPX_QUANTIZE_BUCKET_SIZE",
        "MPX_QUANTIZE_MINIMAL_SIZE",
    ):
        monkeypatch.delenv(name, raising=False)
    group = object()
    state = CGXState(group, layer_min_size=8)  # type: ignore[arg-type]
    # CGX's: 32 bits (exact), 1024 values, layer_min_size at least the minimal size 16
    assert (state.quantization_bits, state.quantization_bucket_size) == (32, 1024)
    assert (state.layer_min_size, state.step, state.process_group) == (16, 0, group)
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "6")
    monkeypatch.setenv("CGX_COMPRESSION_BUCKET_SIZE", "128")
    state = CGXState(group, compression_params={"bits": 3})  # type: ignore[arg-type]
    assert (state.quantization_bits, state.quantization_bucket_size) == (3, 128)
    assert state.should_compress_(torch.zeros(32, 32))
    assert not state.should_compress_(torch.zeros(2048))  # one dimension
    assert not state.should_compress_(torch.zeros(10, 10))  # under layer_min_size
    with pytest.raises(QuantizeValueError, match="bits=12"):
        CGXState(group, compression_params={"bits": 12})  # type: ignore[arg-type]
    with pytest.raises(QuantizeValueError, match="bucket_size=0"):
        CGXState(group, compression_params={"bucket_size": 0})  # type: ignore[arg-type]
    monkeypatch.setenv("CGX_COMPRESSION_QUANTIZATION_BITS", "40")
    with pytest.raises(QuantizeValueError, match="CGX_COMPRESSION_QUANTIZATION_BITS='40'"):
        CGXState(group)  # type: ignore[arg-type]
