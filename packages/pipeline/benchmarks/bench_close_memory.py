"""What a Pipeline built and closed leaves behind: resident memory per pipeline.

``mpxrun -n 2 -- python packages/pipeline/benchmarks/bench_close_memory.py [--count N]
[--step]`` builds and closes N pipelines (one ``nn.Linear(8, 8)`` a rank, 2
micro-batches, 1F1B; ``--step``: one training step each) after 200 untimed ones
(allocator pools, MPI's first communicators), and prints on rank 0 the growth of
the resident set (``VmRSS``) over the N, per pipeline. A closed pipeline that
something still references keeps its stages, runtime and communicator objects:
before the channel's finalizer stopped holding the channel (issue 59), each one
kept ~57 KiB.
"""

from __future__ import annotations

import argparse
import gc

import torch
from torch import nn

from mpx.collectives import world
from mpx.pipeline import Pipeline


def resident_mib() -> float:
    """This process's resident set, from /proc (Linux)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status: this benchmark needs Linux")


def build_and_close(step: bool) -> None:
    size = world().size
    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(*[nn.Linear(8, 8) for _ in range(size)]), chunks=2,
                    balance=[1] * size, schedule="1f1b")  # fmt: skip
    if step:
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        pipe.step(torch.randn(4, 8), torch.randn(4, 8), nn.functional.mse_loss, opt)
    pipe.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="pipelines measured")
    parser.add_argument("--step", action="store_true", help="one training step each")
    args = parser.parse_args()
    for _ in range(200):
        build_and_close(args.step)
    gc.collect()
    before = resident_mib()
    for i in range(args.count):
        build_and_close(args.step)
        if world().rank == 0 and (i + 1) % 250 == 0:
            print(f"{i + 1} of {args.count} pipelines", flush=True)
    gc.collect()
    after = resident_mib()
    if world().rank == 0:
        per = (after - before) * 1024 / args.count
        print(f"resident set {before:.1f} -> {after:.1f} MiB over {args.count} pipelines "
              f"({'with' if args.step else 'no'} step): {per:.1f} KiB per pipeline")  # fmt: skip


if __name__ == "__main__":
    main()
