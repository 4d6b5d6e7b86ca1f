"""Live recovery under ``mpxrun --replica-groups 2``: survivor stall, rejoin time, step overhead.

The model is torchft's ``train_ddp.py`` size (an MLP of 1.3 M parameters,
784-1024-512-10, batch 64, SGD with momentum); each replica group is one
process. Three runs:

* baseline: the same training without fault tolerance, ``mpxrun -n 2`` with
  ``DistributedOptimizer`` (MPI), median step time;
* ft: ``FaultTolerantOptimizer`` over two replica groups, no failure, median
  step time (the overhead is ft / baseline - 1, baseline and ft alternated
  ``--rounds`` times: the median of the rounds' ratios); the gradients go through
  shared memory (both groups are on this host, see recovery.shm); once more over
  TCP alone (``MPX_FT_SHM=0``: the path between hosts);
* kill: group 1 SIGKILLs itself in its backward at step ``KILL_AT`` and is
  restarted by ``--max-restarts``. Survivor stall: the gap between group 0's
  last commit before the kill and its first commit after, less a median step.
  Rejoin: from the restarted group's optimizer being ready (its imports and
  start are not counted: they are the launcher's and Python's) to its first
  committed step with the survivor; the survivor's pause at the rejoin is that
  step's time (zero_grad to step's return), less the median of those.

Prints a markdown table; ``--curve`` (the demo) also prints the kill run's loss
per step and group. ``--load N`` runs N CPU-bound processes beside the jobs for
the whole bench (a loaded machine: does it count a live group out?);
``--kill-only`` runs the kill job alone (its survivor's own failure-free steps
give the step time); ``--placement "--virtual-nodes 2"`` passes mpxrun flags that
put each group on a host of its own. The heartbeat timeout is mpxrun's default
unless ``--heartbeat-timeout`` gives one. Usage:
``python bench_live_recovery.py [--steps N] [--rounds R] [--curve] [--load N]
[--kill-only] [--placement FLAGS] [--heartbeat-timeout S]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

KILL_AT = 30
PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    import torch
    from torch import nn
    import mpx.dataparallel as dp

    mode, steps, kill_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    attempt = int(os.environ.get("MPX_RESTART_COUNT", "0"))
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))
    if mode == "ddp":
        dp.init()
        who = dp.rank()
        opt = dp.DistributedOptimizer(opt, model)
        dp.synchronize(model)
    else:
        who = int(os.environ["MPX_REPLICA_GROUP"])
        opt = dp.FaultTolerantOptimizer(opt, model)
    log = open(f"{out}/{mode}_{who}_{attempt}.jsonl", "w")
    log.write(json.dumps({"ready": time.monotonic()}) + "\\n")
    s = 0
    while s < steps:
        if mode == "ft" and kill_at >= 0 and s >= kill_at + 10 and who == 0:
            # The survivor waits for the restarted group (Python and torch start:
            # seconds) so that it rejoins before the end; not counted anywhere. It
            # watches for its log, as bench_torchft's survivor does: the heartbeats'
            # list of live groups (live_groups) comes up to an interval late, which
            # the rejoin would count.
            while not os.path.exists(f"{out}/ft_1_1.jsonl"):
                time.sleep(0.01)
            if len(opt.members) < 2:
                # then steps slowly until it is a member: its hello comes before
                # it has built its model, and 40 quick steps could end the run
                time.sleep(0.005)
        t0 = time.monotonic()
        opt.zero_grad()
        if mode == "ft":
            s = opt.step_count
            if opt.recovered:
                # Caught up: it applied the step it joined with the survivor (its first
                # commit) and got the loop's state after it; now a member of step s.
                log.write(json.dumps({"caught_up": time.monotonic(), "step": s}) + "\\n")
        gen = torch.Generator().manual_seed(s * 10 + who)
        x = torch.randn(64, 784, generator=gen)
        y = (x @ teacher).argmax(1)  # a task to learn: the loss curve goes down
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if mode == "ft" and kill_at >= 0 and who == 1 and attempt == 0 and s == kill_at:
            os.kill(os.getpid(), 9)
        ok = opt.step() if mode == "ft" else (opt.step(), True)[1]
        members = opt.members if mode == "ft" else [0, 1]
        entry = {"step": s, "ok": ok, "t0": t0, "t": time.monotonic(), "members": members,
                 "loss": loss.item()}
        log.write(json.dumps(entry) + "\\n")
        log.flush()
        if mode == "ddp":
            s += 1
        elif ok:
            s = opt.step_count
    """
)


@dataclasses.dataclass(frozen=True)
class Launch:
    """How the fault-tolerant jobs start (from the command line): mpxrun's flags placing
    the groups, and more environment."""

    placement: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def _job(launch: Launch, out: Path, mode: str, steps: int, kill_at: int, shm: str = "1") -> None:
    script = out / "job.py"
    script.write_text(PROGRAM)
    mpxrun = str(Path(sys.executable).parent / "mpxrun")
    if mode == "ddp":
        command = [mpxrun, "-n", "2", "--timeout", "600"]
    else:
        command = [mpxrun, "--replica-groups", "2", "--max-restarts", "1", "--timeout", "600"]
        command += launch.placement
    command += ["--", sys.executable, str(script), mode, str(steps), str(kill_at), str(out)]
    env = dict(os.environ, **dict(launch.env), MPX_FT_SHM=shm)
    subprocess.run(command, check=True, timeout=900, env=env)


def _read(path: Path) -> tuple[float, list[dict[str, Any]]]:
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return float(lines[0]["ready"]), lines[1:]


def _median_step(entries: list[dict[str, Any]]) -> float:
    times = [float(e["t"]) for e in entries]
    gaps = [b - a for a, b in itertools.pairwise(times[5:])]
    return statistics.median(gaps)


def recovery_rows(run: Path, mode: str, step: float) -> list[tuple[str, str]]:
    """The kill run's figures from its logs (``{mode}_{group}_{attempt}.jsonl``; group 0
    survives, group 1 is killed at ``KILL_AT`` and restarted once); ``step``: the median
    step without failures. bench_torchft measures torchft with this too."""
    _, survivor = _read(run / f"{mode}_0_0.jsonl")
    committed = [e for e in survivor if e["ok"]]
    before = max(float(e["t"]) for e in committed if int(e["step"]) < KILL_AT)
    after = min(float(e["t"]) for e in committed if int(e["step"]) >= KILL_AT)
    lost = sum(1 for e in survivor if not e["ok"])
    ready, back = _read(run / f"{mode}_1_1.jsonl")
    joint = min(float(e["t"]) for e in back if "ok" in e and e["ok"] and len(e["members"]) == 2)
    caught_up = [float(e["caught_up"]) for e in back if "caught_up" in e]
    first_joint = min(
        (e for e in committed if len(e["members"]) == 2 and int(e["step"]) > KILL_AT),
        key=lambda e: float(e["t"]),
    )
    usual = statistics.median(float(e["t"]) - float(e["t0"]) for e in committed)
    # The survivor's steps the rejoin touched: the first joint one, and (mpx) the one
    # the restarted group joined, just before (the state went out beside it).
    touched = [first_joint]
    if caught_up:
        touched += [max((e for e in committed if float(e["t"]) < float(first_joint["t"])),
                        key=lambda e: float(e["t"]))]  # fmt: skip
    pause = sum(float(e["t"]) - float(e["t0"]) - usual for e in touched)
    rows = [
        ("survivor stall after the SIGKILL", f"{(after - before - step) * 1e3:.0f} ms"),
        ("steps discarded", str(lost)),
    ]
    if caught_up:
        # Its first commit is the step it joined: the survivor's commit of it (the
        # restarted group applies it as the survivor does; one clock: one host).
        joined = float(touched[1]["t"])
        rows += [
            (
                "rejoin: restarted group ready -> its first commit (the step it joined)",
                f"{(joined - ready) * 1e3:.0f} ms",
            ),
            (
                "rejoin: restarted group ready -> caught up (zero_grad returns, a member)",
                f"{(caught_up[0] - ready) * 1e3:.0f} ms",
            ),
        ]
    rows += [
        (
            "rejoin: restarted group ready -> its first joint step (its own gradients)",
            f"{(joint - ready) * 1e3:.0f} ms",
        ),
        (f"survivor's pause at the rejoin ({len(touched)} step(s))", f"{pause * 1e3:.0f} ms"),
    ]
    return rows


def _curve(run: Path) -> None:
    """The loss of every group at every committed step: the survivor's curve goes on
    through the kill, the restarted group's picks up where the survivor is."""
    losses: dict[int, dict[int, float]] = {}
    members: dict[int, list[int]] = {}
    for path in sorted(run.glob("ft_*_*.jsonl")):
        group = int(path.stem.split("_")[1])
        for entry in _read(path)[1]:
            if entry.get("ok"):
                losses.setdefault(int(entry["step"]), {})[group] = float(entry["loss"])
                members[int(entry["step"])] = entry["members"]
    print("| step | members | loss, group 0 | loss, group 1 |")
    print("|---|---|---|---|")
    for step in sorted(losses):
        row = [f"{losses[step][g]:.4f}" if g in losses[step] else "(down)" for g in (0, 1)]
        print(f"| {step} | {members[step]} | {row[0]} | {row[1]} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="baseline and fault-tolerant runs alternated this many times: the overhead is "
        "the median of the rounds' ratios (one run moves by 10-20 %% on this VM)",
    )
    parser.add_argument(
        "--curve",
        action="store_true",
        help="demo: also print the kill run's loss per step and group, with the membership",
    )
    parser.add_argument("--load", type=int, default=0, help="CPU-bound processes beside")
    parser.add_argument("--kill-only", action="store_true", help="the kill job alone")
    parser.add_argument("--placement", default="", help='mpxrun flags, e.g. "--virtual-nodes 2"')
    parser.add_argument("--heartbeat-timeout", help="MPX_FT_HEARTBEAT_TIMEOUT (default mpxrun's)")
    args = parser.parse_args()
    beats = (("MPX_FT_HEARTBEAT_TIMEOUT", args.heartbeat_timeout),) * bool(args.heartbeat_timeout)
    launch = Launch(tuple(shlex.split(args.placement)), beats)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        _bench(args, launch)
    finally:
        for hog in hogs:
            hog.kill()


def _bench(args: argparse.Namespace, launch: Launch) -> None:
    rows: list[tuple[str, str]] = []
    where = f", placement {args.placement!r}" * bool(args.placement)
    title = f"2 replica groups of 1 process, {args.load} CPU-bound processes beside{where}"
    if args.kill_only:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "kill").mkdir()
            _job(launch, Path(tmp) / "kill", "ft", args.steps, KILL_AT)
            _, survivor = _read(Path(tmp) / "kill" / "ft_0_0.jsonl")
            step = statistics.median(float(e["t"]) - float(e["t0"]) for e in survivor if e["ok"])
            rows.append(("survivor's median step (zero_grad to step)", f"{step * 1e3:.1f} ms"))
            rows += recovery_rows(Path(tmp) / "kill", "ft", step)
        print(f"| MLP 1.3 M parameters, {title}, kill run | |")
        print("|---|---|")
        for name, value in rows:
            print(f"| {name} | {value} |")
        return
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        pairs: list[tuple[float, float]] = []
        for i in range(args.rounds):
            for name in (f"ddp{i}", f"ft{i}"):
                (base / name).mkdir()
            _job(launch, base / f"ddp{i}", "ddp", args.steps, -1)
            _job(launch, base / f"ft{i}", "ft", args.steps, -1)
            pairs.append(
                (
                    _median_step(_read(base / f"ddp{i}" / "ddp_0_0.jsonl")[1]),
                    _median_step(_read(base / f"ft{i}" / "ft_0_0.jsonl")[1]),
                )
            )
            print(f"round {i + 1} of {args.rounds}: {pairs[-1][1] / pairs[-1][0] - 1:+.0%}")
        for name in ("tcp", "kill"):
            (base / name).mkdir()
        _job(launch, base / "tcp", "ft", args.steps, -1, shm="0")
        _job(launch, base / "kill", "ft", args.steps, KILL_AT)
        ft = statistics.median(f for _, f in pairs)
        overheads = sorted(f / d - 1 for d, f in pairs)
        rows.append(("step, DistributedOptimizer (MPI, no fault tolerance)", _ms_range(pairs, 0)))
        rows.append(("step, FaultTolerantOptimizer, 2 groups, no failure", _ms_range(pairs, 1)))
        rows.append(
            (
                "overhead without failures (median of rounds; range)",
                f"{statistics.median(overheads) * 100:+.0f} % "
                f"({overheads[0] * 100:+.0f} .. {overheads[-1] * 100:+.0f} %)",
            )
        )
        tcp = _median_step(_read(base / "tcp" / "ft_0_0.jsonl")[1])
        rows.append(
            ("step, FaultTolerantOptimizer over TCP only (MPX_FT_SHM=0)", f"{tcp * 1e3:.1f} ms")
        )
        rows += recovery_rows(base / "kill", "ft", ft)
        if args.curve:
            _curve(base / "kill")
    print(f"| MLP 1.3 M parameters, {title}, {args.rounds} rounds | |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def _ms_range(pairs: list[tuple[float, float]], which: int) -> str:
    """The median step of the rounds, and their range, in ms."""
    times = sorted(pair[which] * 1e3 for pair in pairs)
    return f"{statistics.median(times):.1f} ms ({times[0]:.1f}-{times[-1]:.1f})"


if __name__ == "__main__":
    main()
