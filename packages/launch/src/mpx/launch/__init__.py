"""mpx-launch: start MPI jobs with ``mpxrun`` and find your place in them.

Example::

    from mpx.launch import environment, init_torch_env
    env = init_torch_env()          # RANK, WORLD_SIZE, MASTER_ADDR, ... for torch
    print(env.rank, env.world_size)
"""

from typing import TYPE_CHECKING

from mpx.launch.environment import (
    Environment,
    address_towards,
    environment,
    free_port,
    init_torch_env,
    init_torch_env_under_mpi,
    open_mpi_variables,
)
from mpx.launch.errors import (
    LaunchEnvironmentError,
    LauncherNotFound,
    LaunchError,
    MPXError,
    SettingError,
    UsageError,
)
from mpx.launch.handshake import NONCE_BYTES, PROOF_BYTES, JobKey, from_hex, new_nonce
from mpx.launch.launchers import Launcher, find_launcher

__all__ = [
    "NONCE_BYTES",
    "PROOF_BYTES",
    "Environment",
    "JobKey",
    "LaunchEnvironmentError",
    "LaunchError",
    "Launcher",
    "LauncherNotFound",
    "MPXError",
    "SettingError",
    "UsageError",
    "__version__",
    "address_towards",
    "environment",
    "find_launcher",
    "free_port",
    "from_hex",
    "init_torch_env",
    "init_torch_env_under_mpi",
    "new_nonce",
    "open_mpi_variables",
]

# pyproject.toml's version, as installed: the one place it is written. Read on
# first use: importlib.metadata takes 12-30 ms to import here, and the hook
# (mpx_launch_hook.pth) imports this package in every Python process of a job,
# the rank supervisors' included (issue 59: mpxrun's start-up).
__version__: str

if not TYPE_CHECKING:  # mypy sees the declaration above, not a catch-all attribute

    def __getattr__(name: str) -> str:
        global __version__  # noqa: PLW0603 (the module attribute, set on first use)
        if name != "__version__":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        from importlib import metadata

        __version__ = metadata.version("mpx-launch")
        return __version__
