"""mpxrun --settings and mpxrun --tune, as a user runs them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    # The exit code is what is tested: check=False, and the output shown on failure.
    return subprocess.run(args, env=env, capture_output=True, text=True, timeout=360, check=False)


def test_settings_lists_packages_and_flags_bad_values(user_environment: dict[str, str]) -> None:
    env = {k: v for k, v in user_environment.items() if not k.startswith("MPX_")}
    ok = _run([MPXRUN, "--settings"], env)
    assert ok.returncode == 0, ok.stderr
    for name in ("MPX_COLLECTIVES_IMPL", "MPX_AUTO_SMALL_BYTES", "MPX_QUANTIZE_BITS", "MPX_GPUS"):
        assert f"`{name}`" in ok.stdout
    env["MPX_RING_CHUNK_BYTES"] = "1 mebibyte"
    bad = _run([MPXRUN, "--settings"], env)
    assert bad.returncode == 1
    assert "MPX_RING_CHUNK_BYTES='1 mebibyte'" in bad.stderr
    assert "a size such as 64K, 1M or 2G" in bad.stderr


def test_tune_writes_a_policy_that_auto_follows(
    tmp_path: Path, user_environment: dict[str, str]
) -> None:
    policy = tmp_path / "policy.json"
    options = ["--max-size", "16K", "--ops", "allreduce,broadcast", "--output", str(policy)]
    run = _run([MPXRUN, "-n", "2", "--timeout", "300", "--tune", "--", *options], user_environment)
    assert run.returncode == 0, run.stderr
    assert "tuning allreduce, broadcast on ranks=2,nodes=1,node_size=2" in run.stdout
    assert f"wrote {policy}" in run.stdout
    layout = json.loads(policy.read_text())["layouts"]["ranks=2,nodes=1,node_size=2"]
    assert set(layout["bands"]) == {"allreduce", "broadcast"}
    # A job that reads it says so in its DEBUG log of the first decision.
    program = tmp_path / "job.py"
    program.write_text(
        "import logging, os, torch\n"
        "logging.basicConfig(level=logging.DEBUG)\n"
        "from mpx.collectives import allreduce, world\n"
        "from mpx.collectives.core import policy\n"
        "t = torch.ones(1024); allreduce(t)\n"
        "assert float(t[0]) == world().size\n"
        # One write() per line: print() under PYTHONUNBUFFERED writes its parts
        # separately, and the other rank's line may land between them.
        "os.write(1, f'SOURCE {policy.current().source}\\n'.encode())\n"
    )
    job = _run(
        [MPXRUN, "-n", "2", "--timeout", "300", "--", sys.executable, str(program)],
        {**user_environment, "MPX_POLICY_FILE": str(policy)},
    )
    assert job.returncode == 0, job.stderr
    assert job.stdout.count(f"SOURCE {policy}") == 2
    assert "allreduce of a CPU tensor of 4096 bytes" in job.stderr
