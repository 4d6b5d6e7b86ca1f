"""Time lost per restart under ``mpxrun --max-restarts``: teardown, start, resume.

A data-parallel job (an MLP of ``--width``, float32, SGD with momentum)
checkpoints after every step with ``save_resumable``; on the first attempt
rank 1 SIGKILLs itself at step ``KILL_AT``. The benchmark reads the job's
output as it comes and stamps each line on arrival:

* teardown: from the victim's last line to mpxrun's "Restart 1 of 1";
* start: from there to the restarted program's first line (the launcher,
  Python, torch and MPI start-up, ``import mpx.dataparallel``);
* resume: ``dp.resume`` (find the newest complete checkpoint, read it, verify
  its SHA-256, broadcast it, load model, optimizer and RNG states);
* lost: the restarted job's wall time less an uninterrupted job's, which
  adds the steps redone (none here: the checkpoint is one step old) and the
  failed attempt's slower start to the three above.

Prints a markdown section (``nox -s bench`` writes it into BENCHMARKS.md).
Usage: ``python bench_restart.py [--repeats N] [--nprocs P] [--width W]``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch

STEPS = 20
KILL_AT = 10
PROGRAM = textwrap.dedent(
    """
    import os, signal, sys, time
    import torch
    from torch import nn
    import mpx.dataparallel as dp
    from mpx.launch.settings import RESTART_COUNT

    directory = sys.argv[1]
    width, steps, kill_at = (int(a) for a in sys.argv[2:5])
    attempt = RESTART_COUNT.get()
    if dp.rank() == 0:
        os.write(1, f"started {attempt}\\n".encode())
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9), model)
    tick = time.perf_counter()
    point = dp.resume(directory, model, opt)
    if dp.rank() == 0:
        os.write(1, f"resumed {attempt} {time.perf_counter() - tick:.6f}\\n".encode())
    x = torch.randn(32, width)
    for step in range(point.batch, steps):
        if step == kill_at and attempt == 0 and dp.rank() == 1:
            os.write(1, b"dying\\n")
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        dp.save_resumable(directory, model, opt, epoch=0, batch=step + 1)
    """
)


def _job(script: Path, directory: Path, nprocs: int, width: int, kill_at: int) -> dict[str, float]:
    """Runs one job; the arrival time of each marker line, and the wall time."""
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    options = ["-n", str(nprocs), "--timeout", "300", "--max-restarts", "1", "--"]
    arguments = [str(directory), str(width), str(STEPS), str(kill_at)]
    cmd = [mpxrun, *options, sys.executable, str(script), *arguments]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    seen: dict[str, float] = {}
    for line in proc.stdout:
        now = time.perf_counter() - start
        if line.startswith("dying"):
            seen["dying"] = now
        elif "Restart 1 of 1" in line:
            seen["restart"] = now
        elif line.startswith("started 1"):
            seen["started"] = now
        elif line.startswith("resumed 1"):
            seen["resume"] = float(line.split()[2])
    if proc.wait() != 0:
        raise SystemExit(f"bench_restart: {' '.join(cmd)} failed (exit {proc.returncode})")
    seen["wall"] = time.perf_counter() - start
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    load = os.getloadavg()[0]  # the start-up phases scale with it on a shared machine
    rows: dict[str, list[float]] = {k: [] for k in ("teardown", "start", "resume", "lost")}
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(PROGRAM)
        for i in range(args.repeats):
            straight = _job(script, Path(tmp) / f"s{i}", args.nprocs, args.width, -1)
            restarted = _job(script, Path(tmp) / f"r{i}", args.nprocs, args.width, KILL_AT)
            rows["teardown"].append(restarted["restart"] - restarted["dying"])
            rows["start"].append(restarted["started"] - restarted["restart"])
            rows["resume"].append(restarted["resume"])
            rows["lost"].append(restarted["wall"] - straight["wall"])
    params = 2 * (args.width * args.width + args.width)
    print("## mpx-dataparallel: time lost per restart (`mpxrun --max-restarts`)\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}, torch {torch.__version__}, load average {load:.1f} at "
        f"the start; {args.nprocs} ranks; MLP "
        f"with {params / 1e6:.1f} M float32 parameters, SGD with momentum, a checkpoint after "
        f"each of {STEPS} steps; rank 1 SIGKILLed at step {KILL_AT} of the first attempt. "
        f"Median of {args.repeats} runs (`python packages/dataparallel/benchmarks/"
        f"bench_restart.py --nprocs {args.nprocs} --width {args.width}`).\n"
    )
    print("| phase | median | min | max |")
    print("|---|---|---|---|")
    names = {
        "teardown": "teardown: rank 1 killed → mpxrun announces the restart",
        "start": "start: announcement → restarted program running (launcher, Python, imports, MPI)",
        "resume": "resume: `dp.resume` (find, verify, broadcast, load)",
        "lost": "lost: restarted job's wall time − an uninterrupted job's",
    }
    for key, label in names.items():
        values = rows[key]
        print(
            f"| {label} | {statistics.median(values):.3f} s | {min(values):.3f} s | "
            f"{max(values):.3f} s |"
        )
    print(
        "\nTeardown (mpxrun's 1 s launcher grace, then SIGTERM) and resume are the parts mpx "
        "controls; start is mostly `import torch` and MPI start-up (mpxrun's own share: the "
        'mpx-launch table). "Lost" also counts the restarted attempt\'s steps running '
        "slower or faster than the straight job's: on a loaded machine, read it as noisy."
    )


if __name__ == "__main__":
    main()
