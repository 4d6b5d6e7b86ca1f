"""An unmodified torchrun-style DDP script: no mpx import, the backend named on the command line.

It runs the same under ``torchrun --nproc-per-node 2`` and under mpxrun::

    mpxrun -n 2 -- python examples/ddp_torchrun.py --backend mpx
    mpxrun -n 2 -- python examples/ddp_torchrun.py --backend gloo

mpxrun exports torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) and mpx-collectives registers the ``mpx`` backend
when torch is imported (entry point ``torch.backends``), so
``init_process_group(backend)`` with its default ``env://`` needs nothing
more. Rank 0 prints one line per step: the loss, and a checksum of the
weights (equal on mpx and gloo: both sum the 2 ranks' float32 gradients
exactly; on "cgx" at 4 bits they differ a little).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="mpx")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    assert rank == int(os.environ["RANK"])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 3))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for step in range(args.steps):
        x = torch.randn(16, 8, generator=data)
        y = torch.randint(0, 3, (16,), generator=data)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if rank == 0:
            weights = sum(float(p.sum()) for p in model.parameters())
            line = f"step {step} loss {loss.item():.17g} weights {weights:.17g}\n"
            os.write(1, line.encode())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
