"""One data-parallel training step and a few collectives; rank 0 saves the results.

Run by test_multinode.py twice, with the same 4 ranks: on one node, and on two
virtual nodes (network namespaces). The results must agree.
"""

from __future__ import annotations

import sys

import torch

import mpx.dataparallel as dp
from mpx.collectives import allgather, allreduce, broadcast, world

out = sys.argv[1]
comm = dp.init()
torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(32, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
    torch.nn.Linear(512, 10),
).double()  # fmt: skip
model = dp.synchronize(model)
opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
generator = torch.Generator().manual_seed(1)
x = torch.randn(4 * comm.size, 32, generator=generator, dtype=torch.float64)
y = torch.randint(0, 10, (4 * comm.size,), generator=generator)
mine = slice(4 * comm.rank, 4 * (comm.rank + 1))
for _ in range(2):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x[mine]), y[mine]).backward()
    opt.step()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
big = torch.arange(1 << 20, dtype=torch.float64) * (comm.rank + 1)
allreduce(big)  # auto: hier across nodes, shm on one node
b = torch.full((300_000,), float(comm.rank))
broadcast(b, comm.size - 1)
gathered = allgather(torch.tensor([comm.rank]))
if world().rank == 0:
    torch.save(
        {"params": params, "allreduce": big, "broadcast": b, "allgather": gathered,
         "nodes": world().num_nodes},
        out,
    )  # fmt: skip
