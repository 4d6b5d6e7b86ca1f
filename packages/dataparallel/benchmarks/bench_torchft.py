"""torchft beside mpx's live recovery: the same model, the same kill, the same figures.

The peer of ``bench_live_recovery.py`` (issue 48), run the way torchft's own
``train_ddp.py`` runs, with torchft's defaults: a lighthouse (started here, in
this process; ``--heartbeat-timeout-ms`` to change its default), two replica
groups of one process each, every group with its own TCPStore, a
``torchft.Manager`` over torchft's ``ProcessGroupGloo`` and torchft's
``OptimizerWrapper`` (the quorum starts in ``zero_grad``, the optimizer steps
only if ``should_commit``). The gradients are averaged with
``Manager.allreduce`` on one flat buffer a step -- what torchft's
``DistributedDataParallel`` does per bucket, without the hook that asserts in
the survivor after gloo's "connection reset" (issue 48). The model, batch, data
and kill step are bench_live_recovery's: an MLP of 1.3 M parameters
(784-1024-512-10), batch 64, SGD with momentum. Three runs:

* baseline: the same training without fault tolerance, two processes with
  torch's ``DistributedDataParallel`` on gloo, median step time;
* ft: torchft, two replica groups, no failure, median step time;
* kill: group 1 SIGKILLs itself in its backward at step ``KILL_AT``; this
  script restarts it (as ``mpxrun --max-restarts`` does for mpx). Survivor
  stall, steps discarded, rejoin (restarted process's optimizer ready -> its
  first committed step) and the survivor's pause are measured as
  bench_live_recovery measures them.

torchft is an optional peer (``pip install torchft``): without it the script
says so and exits 0. Usage: ``python bench_torchft.py [--steps N]``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# The model, data, kill step and figures are bench_live_recovery's (this folder is
# on the path when the script runs, as bench_conv1d takes bench_transformer's).
RECOVERY = importlib.import_module("bench_live_recovery")
KILL_AT: int = RECOVERY.KILL_AT

PROGRAM = textwrap.dedent(
    """
    import json, os, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch import nn

    mode, steps, kill_at, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    who = int(sys.argv[5])
    attempt = int(os.environ.get("BENCH_ATTEMPT", "0"))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(),
                          nn.Linear(512, 10))
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    teacher = torch.randn(784, 10, generator=torch.Generator().manual_seed(7))
    if mode == "gloo":
        dist.init_process_group("gloo", rank=who, world_size=2)
        net = nn.parallel.DistributedDataParallel(model)
    else:
        from torchft import Manager, ProcessGroupGloo
        from torchft.optim import OptimizerWrapper

        store = dist.TCPStore("localhost", 0, 1, is_master=True, wait_for_workers=False)

        def state_dict():
            return {"model": model.state_dict(), "optim": inner.state_dict()}

        def load_state_dict(state):
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optim"])

        manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
            load_state_dict=load_state_dict,
            state_dict=state_dict,
            min_replica_size=1,
            replica_id=f"bench_{who}",
            store_addr="localhost",
            store_port=store.port,
            rank=0,
            world_size=1,
        )
        opt = OptimizerWrapper(manager, inner)
        net = model
    if mode == "ft" and attempt == 0:
        # both groups start together (torchft's first quorum takes whoever is up;
        # a group starting seconds later would join as a rejoin, not from step 0)
        open(f"{out}/up_{who}", "w").close()
        while not all(os.path.exists(f"{out}/up_{g}") for g in (0, 1)):
            time.sleep(0.01)
    log = open(f"{out}/{mode}_{who}_{attempt}.jsonl", "w")
    log.write(json.dumps({"ready": time.monotonic()}) + "\\n")
    log.flush()
    s = 0
    while s < steps:
        if mode == "ft" and kill_at >= 0 and s == kill_at + 10 and who == 0:
            # The survivor waits for the restarted process (Python, torch and
            # torchft's start: seconds) so that it rejoins before the end; not counted.
            while not os.path.exists(f"{out}/ft_1_1.jsonl"):
                time.sleep(0.01)
        t0 = time.monotonic()
        if mode == "gloo":
            inner.zero_grad()
        else:
            opt.zero_grad()  # torchft: starts this step's quorum
            s = manager.current_step()
        gen = torch.Generator().manual_seed(s * 10 + who)
        x = torch.randn(64, 784, generator=gen)
        y = (x @ teacher).argmax(1)
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        if mode == "ft" and kill_at >= 0 and who == 1 and attempt == 0 and s == kill_at:
            os.kill(os.getpid(), 9)
        if mode == "gloo":
            inner.step()
            ok, members = True, [0, 1]
        else:
            grads = [p.grad for p in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            manager.allreduce(flat).wait()
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            ok = manager.should_commit()
            if ok:
                inner.step()
            members = list(range(manager.num_participants()))
        entry = {"step": s, "ok": ok, "t0": t0, "t": time.monotonic(), "members": members,
                 "loss": loss.item()}
        log.write(json.dumps(entry) + "\\n")
        log.flush()
        if mode == "gloo":
            s += 1
        elif ok:
            s = manager.current_step()
    """
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port: int = s.getsockname()[1]
        return port


def _job(out: Path, mode: str, steps: int, kill_at: int, lighthouse: str) -> None:
    """Both processes of a run; in the kill run, group 1 is restarted once after its SIGKILL."""
    script = out / "job.py"
    script.write_text(PROGRAM)
    env = dict(os.environ, MASTER_ADDR="localhost", MASTER_PORT=str(_free_port()))
    env["TORCHFT_LIGHTHOUSE"] = lighthouse

    def start(who: int, attempt: int) -> subprocess.Popen[bytes]:
        args = [sys.executable, str(script), mode, str(steps), str(kill_at), str(out), str(who)]
        # torchft logs every quorum at INFO: to a file, shown if the process fails
        with open(out / f"log_{who}_{attempt}.txt", "w") as log:
            return subprocess.Popen(
                args, env=dict(env, BENCH_ATTEMPT=str(attempt)), stdout=log, stderr=log
            )

    running = {who: start(who, 0) for who in (0, 1)}
    restarted = False
    deadline = time.monotonic() + 900
    while running:
        if time.monotonic() > deadline:
            for proc in running.values():
                proc.kill()
            raise SystemExit(f"{mode} run: no end after 900 s")
        for who, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[who]
            if code == -9 and who == 1 and kill_at >= 0 and not restarted:
                restarted = True
                running[who] = start(who, 1)
            elif code != 0:
                for other in running.values():
                    other.kill()
                for log in sorted(out.glob(f"log_{who}_*.txt")):
                    sys.stderr.write(log.read_text()[-6000:])
                raise SystemExit(f"{mode} run: process {who} exited with {code}")
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=None,
        help="the lighthouse's heartbeat timeout (torchft's default when not given)",
    )
    args = parser.parse_args()
    try:
        from torchft._torchft import LighthouseServer
    except ImportError as exc:
        print(f"torchft is not installed ({exc}); `pip install torchft` to run this peer")
        return
    options = {}
    if args.heartbeat_timeout_ms is not None:
        options["heartbeat_timeout_ms"] = args.heartbeat_timeout_ms
    rows: list[tuple[str, str]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        for name in ("gloo", "ft", "kill"):
            (base / name).mkdir()
            # a lighthouse a run: no replica of an earlier run is remembered
            lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, **options)
            mode = "ft" if name == "kill" else name
            try:
                _job(
                    base / name,
                    mode,
                    args.steps,
                    KILL_AT if name == "kill" else -1,
                    lighthouse.address(),
                )
            finally:
                lighthouse.shutdown()
        gloo = RECOVERY._median_step(RECOVERY._read(base / "gloo" / "gloo_0_0.jsonl")[1])
        ft = RECOVERY._median_step(RECOVERY._read(base / "ft" / "ft_0_0.jsonl")[1])
        rows.append(("step, torch DDP on gloo (no fault tolerance)", f"{gloo * 1e3:.1f} ms"))
        rows.append(("step, torchft, 2 groups, no failure", f"{ft * 1e3:.1f} ms"))
        rows.append(("overhead without failures", f"{(ft / gloo - 1) * 100:+.0f} %"))
        rows += RECOVERY.recovery_rows(base / "kill", "ft", ft)
        final = [
            RECOVERY._read(base / "kill" / f"ft_{g}_{a}.jsonl")[1][-1] for g, a in ((0, 0), (1, 1))
        ]
        rows.append(
            ("last committed step of each group", f"{final[0]['step']}, {final[1]['step']}")
        )
    version = importlib.metadata.version("torchft")
    print(f"| MLP 1.3 M parameters, 2 replica groups of 1 process, torchft {version} | |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
