"""A training script written as CGX's README shows its usage, run unchanged on mpx.

CGX's README: ``import torch_cgx``; ``dist.init_process_group('cgx',
init_method='env://', rank=args.local_rank)``; the ``OMPI_COMM_WORLD_*`` block
for scripts once started by ``torch.distributed.launch``; the layers registered
in forward order and filtered by name; the ``CGX_COMPRESSION_*`` variables
configure it. ``test_torch_backend.py`` starts it as ``mpxrun -n 2 -- python
cgx_readme_train.py`` with ``CGX_COMPRESSION_QUANTIZATION_BITS=4``.

The last part (marked) is the test's check, not CGX usage: one more batch,
whose gradient DDP reduced on "cgx" is compared with the exact mean of every
rank's own gradient, layer by layer.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch_cgx

parser = argparse.ArgumentParser()
parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
parser.add_argument("--steps", type=int, default=5)
args = parser.parse_args()

if "OMPI_COMM_WORLD_SIZE" in os.environ:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "4040"
    os.environ["WORLD_SIZE"] = os.environ["OMPI_COMM_WORLD_SIZE"]
    os.environ["RANK"] = os.environ["OMPI_COMM_WORLD_RANK"]

dist.init_process_group("cgx", init_method="env://", rank=args.local_rank)
rank, world_size = dist.get_rank(), dist.get_world_size()


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.fc = torch.nn.Linear(8 * 8 * 8, 64)
        self.out = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn(self.conv(x))).flatten(1)
        return self.out(torch.relu(self.fc(x)))  # type: ignore[no-any-return]


torch.manual_seed(0)
model: Any = Net()  # then wrapped by DDP, as CGX's examples do
layers = [(name, p.numel()) for name, p in model.named_parameters()]
torch_cgx.register_model(layers)
torch_cgx.exclude_layer("bn")  # all batch norm layers
torch_cgx.exclude_layer("bias")  # all bias modules
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loss_fn = torch.nn.CrossEntropyLoss()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 1, 8, 8, generator=g)
    return x, (x.mean((1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()


for step in range(args.steps):
    x, y = batch(step)
    optimizer.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    optimizer.step()
    if rank == 0:
        print(f"step {step} loss {loss.item():.4f}", flush=True)

# --- the test's check (not CGX usage) -------------------------------------------
x, y = batch(99)
with model.no_sync():  # this rank's own gradient, not reduced
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
own = {name: p.grad.clone() for name, p in model.module.named_parameters()}
optimizer.zero_grad()
loss_fn(model(x), y).backward()  # the same batch, reduced by DDP on "cgx"
for name, p in model.module.named_parameters():
    every = [torch.empty_like(own[name]) for _ in range(world_size)]
    dist.all_gather(every, own[name])  # exact: only all_reduce is quantized
    exact = torch.stack(every).double().mean(0)
    diff = (p.grad.double() - exact).norm().item()
    error = diff / max(exact.norm().item(), 1e-30)
    kind = "excluded" if "bn" in name or "bias" in name else "quantized"
    print(f"rank {rank} {kind} {name} {error:.3e}", flush=True)
dist.destroy_process_group()
