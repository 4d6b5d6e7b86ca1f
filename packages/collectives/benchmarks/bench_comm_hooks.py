"""torch's DDP comm hooks on the mpx backend against gloo: equal losses? step time mpx / gloo.

``python bench_comm_hooks.py`` starts itself under ``mpxrun -n RANKS`` (2 by
default); in one job, every hook of ``torch.distributed.algorithms.ddp_comm_hooks``
trains the same model on mpx and on gloo, the two interleaved round by round,
and rank 0 prints::

    hook                      equal to gloo    mpx step   gloo step   mpx / gloo
    allreduce                 bitwise          ...

"Equal" is bitwise when every loss is the same float, allclose when they
agree to 1e-5 relative (3 ranks sum in another order than gloo), else
"DIFFERENT" (2e-3 for the fp16 hooks, whose sums round to ~5e-4). A hook
torch itself fails on CPU (on gloo too) is listed as such. Figures are the
best of ``--rounds`` means of ``--steps`` steps after the warm-up (the
hooks' own warm-up included: PowerSGD compresses from step 2). The table of
hooks (:data:`HOOKS`) is also what ``tests/test_comm_hooks.py`` trains, at 1,
2 and 3 ranks.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    debugging_hooks,
    default_hooks,
    optimizer_overlap_hooks,
    post_localSGD_hook,
    powerSGD_hook,
    quantization_hooks,
)

__all__ = ["HOOKS", "train"]

DDP = nn.parallel.DistributedDataParallel
# A hook's set-up: (the DDP model, its process group) -> the optimizer to step,
# or None where the hook steps the parameters itself (optimizer overlap).
Setup = Callable[[DDP, dist.ProcessGroup], "torch.optim.Optimizer | None"]


def _sgd(ddp: DDP) -> torch.optim.Optimizer:
    return torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)


def _hook(hook: Any, state: Callable[[dist.ProcessGroup], Any] | None = None) -> Setup:
    def setup(ddp: DDP, group: dist.ProcessGroup) -> torch.optim.Optimizer:
        ddp.register_comm_hook(group if state is None else state(group), hook)
        return _sgd(ddp)

    return setup


def _builtin(name: str) -> Setup:
    def setup(ddp: DDP, group: dist.ProcessGroup) -> torch.optim.Optimizer:
        kinds: Any = dist.BuiltinCommHookType  # type: ignore[attr-defined]  # (not in the stubs)
        ddp._register_builtin_comm_hook(getattr(kinds, name))  # type: ignore[no-untyped-call]
        return _sgd(ddp)

    return setup


def _power_sgd(batched: bool) -> Setup:
    def state(group: dist.ProcessGroup) -> powerSGD_hook.PowerSGDState:
        return powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=2,
            start_powerSGD_iter=2,
            min_compression_rate=0.5,
            use_error_feedback=True,
            warm_start=True,
            random_seed=5,
        )

    hook = powerSGD_hook.batched_powerSGD_hook if batched else powerSGD_hook.powerSGD_hook
    return _hook(hook, state)


def _fp16_wrapped_power_sgd() -> Setup:
    def setup(ddp: DDP, group: dist.ProcessGroup) -> torch.optim.Optimizer:
        state = powerSGD_hook.PowerSGDState(
            process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2
        )
        wrapped = default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook)
        ddp.register_comm_hook(state, wrapped)
        return _sgd(ddp)

    return setup


def _post_local_sgd(ddp: DDP, group: dist.ProcessGroup) -> torch.optim.Optimizer:
    """Global allreduce for 2 steps, then each rank alone, the model averaged every 2 steps."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    backend = dist.get_backend(group)
    # new_group is collective over every rank: each rank's one-rank subgroup.
    alone = [dist.new_group([r], backend=backend) for r in range(dist.get_world_size())]
    state = post_localSGD_hook.PostLocalSGDState(  # type: ignore[no-untyped-call]
        process_group=group, subgroup=alone[dist.get_rank()], start_localSGD_iter=2
    )
    ddp.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
    averager = PeriodicModelAverager(period=2, warmup_steps=2, process_group=group)
    return PostLocalSGDOptimizer(optim=_sgd(ddp), averager=averager)


def _optimizer_overlap(ddp: DDP, group: dist.ProcessGroup) -> None:
    """The optimizer steps each parameter as soon as its bucket is reduced."""
    ddp._register_fused_optim(torch.optim.SGD, lr=0.05, momentum=0.9)
    assert optimizer_overlap_hooks  # the module DDP uses for it


HOOKS: dict[str, Setup] = {
    "none (DDP's default)": lambda ddp, group: _sgd(ddp),
    "allreduce": _hook(default_hooks.allreduce_hook),
    "fp16_compress": _hook(default_hooks.fp16_compress_hook),
    "bf16_compress": _hook(default_hooks.bf16_compress_hook),
    "builtin ALLREDUCE": _builtin("ALLREDUCE"),
    "builtin FP16_COMPRESS": _builtin("FP16_COMPRESS"),
    "PowerSGD per tensor": _power_sgd(batched=False),
    "PowerSGD batched": _power_sgd(batched=True),
    "fp16_compress_wrapper(PowerSGD)": _fp16_wrapped_power_sgd(),
    "quantization per tensor": _hook(quantization_hooks.quantization_pertensor_hook),
    "quantization per channel": _hook(quantization_hooks.quantization_perchannel_hook),
    "post-localSGD": _post_local_sgd,
    "optimizer overlap": _optimizer_overlap,
    "noop (debugging)": _hook(debugging_hooks.noop_hook),
}


def make_model(width: int = 32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(24, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 4)
    )


def train(
    group: dist.ProcessGroup, hook: str, steps: int = 6, width: int = 32, timed: int = 0
) -> tuple[list[float], float]:
    """Losses of ``steps`` steps with ``hook``, and the mean time of the last ``timed`` steps.

    One bucket (DDP's default 25 MB): with several, torch's PowerSGD callbacks
    start collectives concurrently with the next bucket's, in an order that
    may differ between ranks (gloo hangs then).
    """
    ddp = DDP(make_model(width), process_group=group)
    optimizer = HOOKS[hook](ddp, group)
    data = torch.Generator().manual_seed(11 + dist.get_rank())
    losses: list[float] = []
    started = 0.0
    for step in range(steps):
        if step == steps - timed:
            dist.barrier(group=group)
            started = time.perf_counter()
        x = torch.randn(16, 24, generator=data)
        if optimizer is not None:
            optimizer.zero_grad()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        losses.append(loss.item())
    elapsed = (time.perf_counter() - started) / timed if timed else 0.0
    return losses, elapsed


def equality(mpx: list[float], gloo: list[float], rtol: float = 1e-5) -> str:
    if mpx == gloo:
        return "bitwise"
    if torch.allclose(torch.tensor(mpx), torch.tensor(gloo), rtol=rtol, atol=1e-7):
        return "allclose"
    return "DIFFERENT"


def _run_ranks(args: argparse.Namespace) -> None:
    from mpx.collectives import init_process_group
    from mpx.launch import init_torch_env

    init_torch_env()
    init_process_group("env://")
    groups = {"mpx": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rows = []
    for hook in HOOKS:
        best = {"mpx": float("inf"), "gloo": float("inf")}
        losses: dict[str, list[float]] = {}
        try:
            train(groups["gloo"], hook, 3, args.width)
        except Exception as error:
            rows.append((hook, f"fails on gloo too: {type(error).__name__}", 0.0, 0.0))
            dist.barrier(group=groups["gloo"])
            continue
        for _ in range(args.rounds):
            for name, group in groups.items():
                assert group is not None
                got, seconds = train(group, hook, args.warmup + args.steps, args.width, args.steps)
                losses[name] = got
                # The slowest rank's time is the step time.
                slowest = torch.tensor([seconds])
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=groups["gloo"])
                best[name] = min(best[name], float(slowest))
        rtol = 2e-3 if "FP16" in hook.upper() else 1e-5  # fp16 sums round to ~5e-4
        rows.append(
            (hook, equality(losses["mpx"], losses["gloo"], rtol), best["mpx"], best["gloo"])
        )
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} ranks, width {args.width}, {args.steps} timed steps")
        print(
            f"{'hook':34} {'equal to gloo':14} {'mpx step':>10} {'gloo step':>10} {'mpx/gloo':>9}"
        )
        for hook, equal, mpx, gloo in rows:
            if not gloo:
                print(f"{hook:34} {equal}")
                continue
            print(f"{hook:34} {equal:14} {mpx * 1e3:8.2f}ms {gloo * 1e3:8.2f}ms {mpx / gloo:9.2f}")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2)
    # 256: the model stays in one DDP bucket. At 512 (1.1 MB) DDP's rebuild makes two
    # (its first bucket holds 1 MiB), and torch's PowerSGD callbacks then start the two
    # buckets' collectives in an order that differs between ranks (see train()).
    parser.add_argument("--width", type=int, default=256, help="hidden width of the model")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_side:
        _run_ranks(args)
        return 0
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    command = [mpxrun, "-n", str(args.ranks), "--timeout", "1800", "--", sys.executable, __file__]
    command += sys.argv[1:] if argv is None else argv
    return subprocess.call([*command, "--rank-side"])


if __name__ == "__main__":
    sys.exit(main())
