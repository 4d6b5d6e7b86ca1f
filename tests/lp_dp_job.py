"""Layer parallel x data parallel with mpx-dataparallel's DistributedOptimizer: a job.

Run by tests/test_layer_parallel_replicas.py as ``mpxrun -n 4 -- python lp_dp_job.py``
(any size works). For every factorization R x P of the world size, R replicas of a
P-rank LayerParallel (``mpx.mgrit.split_replicas``), each on its shard of the batch,
train with the README's recipe: the step layers' gradients averaged over the replica
group, the replicated open and close layers' over the whole job. Checked against one
process on the whole batch (the network's own ``serial()`` copy, plain autograd):

* full precision, two SGD steps: equal to 1e-12 (float64);
* compressed (``mpx.quantize.CompressionConfig``, 4 bits, stochastic rounding), one
  step: within the quantization error of one process, and the open and close layers
  bitwise the same on every rank.

Prints one line per case on rank 0; any mismatch raises (the job fails).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, world
from mpx.dataparallel import DistributedOptimizer
from mpx.mgrit import LayerParallel, split_replicas
from mpx.quantize import CompressionConfig

BATCH, STEPS, WIDTH, LR = 12, 10, 32, 0.2  # 12: equal shards for 1 to 4 replicas; 10 steps:
# 5 coarsest intervals, so that the ranks of a layer group own different numbers of steps
BITS = 4


def build(comm: Communicator, dtype: torch.dtype) -> LayerParallel:
    torch.manual_seed(0)  # every rank builds the same layers
    net = LayerParallel(
        nn.Linear(8, WIDTH), lambda: nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()),
        nn.Linear(WIDTH, 4), STEPS, Tf=2.0, comm=comm,
        levels=2, cfactor=2, fwd_iters=STEPS, bwd_iters=STEPS, tol=0.0,
    )  # fmt: skip
    return net.to(dtype)


def batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(BATCH, 8, generator=gen).to(dtype)
    return x, torch.randint(0, 4, (BATCH,), generator=gen)


def optimizers(
    net: LayerParallel, replica: Communicator, comm: Communicator, **options: Any
) -> list[DistributedOptimizer]:
    """The README's recipe: steps over their replicas, open and close layers over the job,
    each optimizer reducing in its step() (overlap=False: see the README)."""
    shared = [*net.open_layer.parameters(), *net.close_layer.parameters()]
    steps = net.local_steps.parameters()
    return [
        DistributedOptimizer(torch.optim.SGD(shared, lr=LR), comm=comm, overlap=False, **options),
        DistributedOptimizer(torch.optim.SGD(steps, lr=LR), comm=replica, overlap=False, **options),
    ]


def train(
    layer_size: int, steps: int, dtype: torch.dtype, **options: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, tuple[float, float]], int]:
    """The trained state of the replicas and of one process, the (max, min) of each
    parameter's gradient on any shard or the whole batch in the last step, and the bytes
    the job-wide optimizer sent."""
    comm = world()
    groups = split_replicas(layer_size, comm)
    net = build(groups.layer, dtype)
    serial = net.serial()
    opts = optimizers(net, groups.replica, comm, **options)
    serial_opt = torch.optim.SGD(serial.parameters(), lr=LR)
    r, replicas = groups.replica.rank, groups.replica.size
    shard = slice(r * BATCH // replicas, (r + 1) * BATCH // replicas)
    for step in range(steps):
        x, y = batch(step, dtype)
        for opt in opts:
            opt.zero_grad()
        nn.functional.cross_entropy(net(x[shard]), y[shard]).backward()
        for opt in opts:
            opt.step()
        extremes: dict[str, tuple[float, float]] = {}
        for part in [*(slice(i * BATCH // replicas, (i + 1) * BATCH // replicas)
                       for i in range(replicas)), slice(None)]:  # fmt: skip
            serial_opt.zero_grad()
            nn.functional.cross_entropy(serial(x[part]), y[part]).backward()
            for n, p in serial.named_parameters():
                assert p.grad is not None
                hi, lo = extremes.get(n, (-math.inf, math.inf))
                extremes[n] = (max(hi, p.grad.max().item()), min(lo, p.grad.min().item()))
        serial_opt.step()  # with the whole batch's gradients, computed last
    state = opts[0].compression_state
    sent = -1 if state is None else int(state.bytes_sent)
    got = net.serial().state_dict()
    for opt in opts:
        opt.close()
    net.close()
    groups.free()
    # The open layer (replicated on every rank) is the same bits everywhere.
    mine = got["open_layer.weight"]
    assert all(torch.equal(o, mine) for o in comm.allgather_object(mine)), "open layers differ"
    return got, serial.state_dict(), extremes, sent


def main() -> None:
    comm = world()
    for layer_size in [p for p in range(1, comm.size + 1) if comm.size % p == 0]:
        replicas = comm.size // layer_size
        got, want, _, _ = train(layer_size, 2, torch.float64)
        plain = max((got[n] - want[n]).abs().max().item() for n in want)
        assert plain <= 1e-12, (layer_size, plain)
        config = CompressionConfig(bits=BITS)
        got, want, extremes, sent = train(layer_size, 1, torch.float32, compression=config)
        # Stochastic rounding to 2^BITS - 1 levels between a bucket's extremes, twice
        # (each rank's gradient, then the reduced chunk): per value at most 2 (max - min)
        # / (2^BITS - 1) of the gradients, times the learning rate. A bucket may hold
        # values of several parameters (small tensors are fused): the extremes of all.
        spread = max(hi for hi, _ in extremes.values()) - min(lo for _, lo in extremes.values())
        bound = LR * 2 * spread / (2**BITS - 1) + 1e-5
        for name in extremes:
            error = (got[name] - want[name]).abs().max().item()
            assert error <= bound, (layer_size, name, error, bound)
        compressed = max((got[n] - want[n]).abs().max().item() for n in want)
        if comm.size > 1:
            assert sent > 0, sent
            assert compressed > 1e-6, compressed  # the gradients really were quantized
        if comm.rank == 0:
            print(
                f"replicas={replicas} layer_size={layer_size}: full precision {plain:.1e}, "
                f"{BITS}-bit compressed {compressed:.1e} from one process",
                flush=True,
            )


if __name__ == "__main__":
    main()
