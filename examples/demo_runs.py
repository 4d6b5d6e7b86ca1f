"""What a run of examples/train_digits.py is called, the layouts it refuses, whose checkpoints.

* :func:`run_name`: the stem of a run's plot and summary: the mode, then what
  changes the result within it, so runs never overwrite each other's files::

      digits_dp_4bit   digits_dp_fp32   digits_ddp   digits_mgrit
      digits_pipeline_<schedule>   digits_2d_<schedule>   gpt_stdlib_<schedule>

* :func:`two_d_refusal`: ``--mode 2d`` is pipeline x data parallel; a layout
  with one stage or one replica would silently be one of them alone.
* :func:`check_owner` / :func:`record_owner`: a checkpoint directory remembers
  the run that wrote it (``demo_run.json`` beside the checkpoints), so a run of
  another mode or schedule is told so instead of a state_dict's missing keys.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["OWNER_FILE", "check_owner", "record_owner", "run_flags", "run_name", "two_d_refusal"]

OWNER_FILE = "demo_run.json"


def run_name(mode: str, schedule: str, bits: int) -> str:
    """The stem of the run's plot and summary (``.png``, ``.json``)."""
    if mode == "gpt":
        return f"gpt_stdlib_{schedule}"
    if mode in ("pipeline", "2d"):
        return f"digits_{mode}_{schedule}"
    if mode == "dp":
        return f"digits_dp_{bits}bit" if bits else "digits_dp_fp32"
    return f"digits_{mode}"


def run_flags(mode: str, schedule: str, bits: int) -> str:
    """The flags that make :func:`run_name`'s run, as typed."""
    if mode in ("pipeline", "2d", "gpt"):
        return f"--mode {mode} --schedule {schedule}"
    if mode == "dp":
        return f"--mode dp --bits {bits}"
    return f"--mode {mode}"


def two_d_refusal(ranks: int, stages: int) -> str | None:
    """Why ``--mode 2d`` cannot run ``stages`` stages on ``ranks`` ranks; None when it can."""
    if stages < 1 or ranks % stages:
        return None  # the caller's check says --stages must divide the ranks
    replicas = ranks // stages
    if stages >= 2 and replicas >= 2:
        return None
    return (
        "mpx demo: --mode 2d is pipeline x data parallel: it needs at least 2 stages and "
        f"2 replicas (4 ranks or more), but {ranks} rank(s) with --stages {stages} make "
        f"{stages} stage(s) x {replicas} replica(s). Run it on 4 ranks: "
        "MPX_DEMO_RANKS=4 python3 -m nox -s demo -- --mode 2d, or "
        "mpxrun -n 4 python examples/train_digits.py --mode 2d "
        "(--mode pipeline is the pipeline alone, --mode dp data parallel alone)"
    )


def check_owner(directory: str, name: str, flags: str) -> str | None:
    """Why this run cannot resume ``directory``'s checkpoints (another run's); None if it can."""
    path = Path(directory) / OWNER_FILE
    if not path.exists():
        return None
    owner = json.loads(path.read_text())
    if owner.get("name") != name:
        return (
            f"mpx demo: the checkpoints in {directory} were written by {owner.get('flags')} "
            f"({owner.get('name')}), not by this run's {flags}: they cannot be resumed here. "
            f"Pass another --checkpoint-dir, or remove it: rm -r {directory}"
        )
    return None


def record_owner(directory: str, name: str, flags: str) -> None:
    """Writes who wrote ``directory``'s checkpoints (rank 0, after each save)."""
    path = Path(directory) / OWNER_FILE
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"name": name, "flags": flags}) + "\n")
    os.replace(temporary, path)  # whole or absent, for a rank killed while writing
