"""Python calls per DDP training step, on the mpx backend and on gloo, by thread.

Timings are noise on a loaded machine; the number of Python calls a step makes
is not, and it is what mpx adds to DDP (gloo's collectives run in C++: its DDP
step calls only torch's own Python). Run under mpxrun::

    mpxrun -n 2 -- python packages/dataparallel/benchmarks/count_ddp_calls.py

Rank 0 prints, for gloo then mpx, the calls per step on each thread (the main
thread, mpx's progress thread) and the ``--top`` functions by calls per step.
The progress thread's count depends on how long it waits (it polls until the
operations are done): compare its calls per poll turn (``progress.py _busy``),
not its total. Every thread is counted from the start (``threading.setprofile``
before the first group), only during the measured steps.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

Key = tuple[str, str, int, str]  # thread, file, first line, function
_counting = [False]
_counts: collections.Counter[Key] = collections.Counter()


def _count(frame: FrameType, event: str, arg: Any) -> None:
    if event == "call" and _counting[0]:
        code = frame.f_code
        name = threading.current_thread().name
        _counts[(name, os.path.basename(code.co_filename), code.co_firstlineno, code.co_name)] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps (default 20)")
    parser.add_argument("--width", type=int, default=256, help="MLP width (default 256)")
    parser.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=0.25,
        help="DDP's bucket cap (default 0.25: 3 buckets)",
    )
    parser.add_argument("--top", type=int, default=30, help="functions listed per backend")
    args = parser.parse_args()
    threading.setprofile(_count)  # threads started from now on: mpx's progress thread
    sys.setprofile(_count)

    import torch
    import torch.distributed as dist
    from torch import nn

    from mpx.collectives import init_process_group
    from mpx.launch import init_torch_env

    init_torch_env()
    init_process_group("env://")
    groups = {"gloo": dist.new_group(backend="gloo"), "mpx": dist.group.WORLD}
    width = args.width
    for backend, group in groups.items():
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
            nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10),
        )  # fmt: skip
        ddp = nn.parallel.DistributedDataParallel(
            model, process_group=group, bucket_cap_mb=args.bucket_cap_mb
        )
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(32, 64)

        def step(
            ddp: nn.Module = ddp, optimizer: torch.optim.Optimizer = optimizer, x: Any = x
        ) -> None:
            optimizer.zero_grad()
            ddp(x).square().mean().backward()
            optimizer.step()

        for _ in range(5):  # DDP rebuilds its buckets after the first step
            step()
        dist.barrier(group=groups["gloo"])
        _counts.clear()
        _counting[0] = True
        for _ in range(args.steps):
            step()
        _counting[0] = False
        time.sleep(0.2)  # the progress thread's last turn
        if dist.get_rank() == 0:
            threads: collections.Counter[str] = collections.Counter()
            for key, calls in _counts.items():
                threads[key[0]] += calls
            total = sum(threads.values()) / args.steps
            per_thread = {name: round(calls / args.steps) for name, calls in threads.items()}
            print(f"== {backend}: {total:.0f} Python calls per step; by thread {per_thread}")
            for key, calls in _counts.most_common(args.top):
                print(f"  {calls / args.steps:8.1f}  {key[0]:<14} {key[1]}:{key[2]} {key[3]}")
        dist.barrier(group=groups["gloo"])
    sys.setprofile(None)
    threading.setprofile(None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
