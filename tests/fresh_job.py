"""The environment an mpxrun started by a test needs to be a job of its own."""

from __future__ import annotations

import os

__all__ = ["fresh_job_environment"]

# What mpxrun exports to its ranks, and keeps when it finds them set (as the user's).
TORCHRUN = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
TORCHRUN |= {"MASTER_ADDR", "MASTER_PORT", "MPX_TORCH_ENV"}


def fresh_job_environment(**extra: str) -> dict[str, str]:
    """This process's environment without its own job's traces, plus ``extra``.

    Neither a rank of a job around this one (nox's mpi runs: ``PMI_*``), nor
    with the torchrun variables an earlier test left in this process
    (``init_torch_env``), which mpxrun would take for the user's.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PMI_") and k not in TORCHRUN}
    return env | extra
