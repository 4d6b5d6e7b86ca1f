"""Where am I in the job? Rank and sizes from whatever launcher started us.

Every MPI launcher announces a process's place in the job through environment
variables, each in its own dialect::

    launcher     rank / size                        local rank / local size
    -----------  ---------------------------------  ----------------------------------------
    Open MPI     OMPI_COMM_WORLD_RANK / _SIZE       OMPI_COMM_WORLD_LOCAL_RANK / _LOCAL_SIZE
    MPICH/Hydra  PMI_RANK / PMI_SIZE                MPI_LOCALRANKID / MPI_LOCALNRANKS
    Slurm srun   SLURM_PROCID / SLURM_NTASKS        SLURM_LOCALID / SLURM_TASKS_PER_NODE
    torchrun     RANK / WORLD_SIZE                  LOCAL_RANK / LOCAL_WORLD_SIZE

:func:`environment` reads them without importing MPI (so it is cheap and works
before ``MPI_Init``), and :func:`init_torch_env` translates them into the
variables ``torch.distributed``'s ``env://`` rendezvous expects.

The MPI variables win over Slurm's and torchrun's: ``mpiexec`` inside a Slurm
allocation inherits ``SLURM_PROCID=0`` from the batch script, and
:func:`init_torch_env` itself writes ``RANK``/``WORLD_SIZE``.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from mpx.launch.errors import LaunchEnvironmentError
from mpx.launch.settings import MASTER_ADDR, MASTER_PORT

__all__ = [
    "MPI_LAUNCHERS",
    "TORCH_VARIABLES",
    "Environment",
    "address_towards",
    "environment",
    "free_port",
    "init_torch_env",
    "init_torch_env_under_mpi",
    "open_mpi_variables",
    "slurm_first_node",
]


@dataclass(frozen=True)
class Environment:
    """A process's place in a distributed job.

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank among the processes on this node.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, ``0 <= node_rank < world_size``.
        launcher: which launcher's variables were read: ``"openmpi"``,
            ``"mpich"``, ``"slurm"``, ``"torchrun"`` or ``"single"``.

    Example::

        env = environment()
        if env.rank == 0:
            print(f"{env.world_size} ranks, started by {env.launcher}")
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    launcher: str

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise LaunchEnvironmentError(
                f"rank {self.rank} is outside [0, {self.world_size}) "
                f"(read from {self.launcher}'s variables)"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise LaunchEnvironmentError(
                f"local rank {self.local_rank} is outside [0, {self.local_world_size}) "
                f"(read from {self.launcher}'s variables)"
            )


def _int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        return int(value)
    except ValueError:
        raise LaunchEnvironmentError(
            f"{name}={value!r} is not an integer; unset it or fix the launcher"
        ) from None


def _slurm_tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Expands Slurm's compressed ``SLURM_TASKS_PER_NODE`` ("2(x3),1") for one node."""
    counts: list[int] = []
    for item in tasks_per_node.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if match is None:
            raise LaunchEnvironmentError(
                f"SLURM_TASKS_PER_NODE={tasks_per_node!r} is not in Slurm's 'N(xM),K' form"
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    if not 0 <= node_id < len(counts):
        raise LaunchEnvironmentError(
            f"SLURM_NODEID={node_id} but SLURM_TASKS_PER_NODE={tasks_per_node!r} "
            f"describes {len(counts)} nodes"
        )
    return counts[node_id]


def _node_rank_by_blocks(rank: int, local_rank: int, local_size: int) -> int:
    # Launchers place ranks on nodes in blocks by default (by-slot mapping):
    # the first local_size ranks on node 0, and so on.
    return (rank - local_rank) // max(local_size, 1)


def environment(env: Mapping[str, str] | None = None) -> Environment:
    """Reads this process's rank and sizes from the launcher's variables.

    Args:
        env: the variables to read; ``os.environ`` by default.

    Returns:
        The :class:`Environment`; rank 0 of 1 (``launcher="single"``) when no
        launcher's variables are present.

    Raises:
        LaunchEnvironmentError: a variable is present but malformed.
    """
    env = os.environ if env is None else env
    if "OMPI_COMM_WORLD_SIZE" in env:
        rank = _int(env, "OMPI_COMM_WORLD_RANK")
        local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK")
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE")
        return Environment(
            rank=rank,
            local_rank=local_rank,
            world_size=_int(env, "OMPI_COMM_WORLD_SIZE"),
            local_world_size=local_size,
            node_rank=_node_rank_by_blocks(rank, local_rank, local_size),
            launcher="openmpi",
        )
    if "PMI_RANK" in env and "PMI_SIZE" in env:
        rank = _int(env, "PMI_RANK")
        size = _int(env, "PMI_SIZE")
        local_rank = _int(env, "MPI_LOCALRANKID") if "MPI_LOCALRANKID" in env else rank
        local_size = _int(env, "MPI_LOCALNRANKS") if "MPI_LOCALNRANKS" in env else size
        return Environment(
            rank=rank,
            local_rank=local_rank,
            world_size=size,
            local_world_size=local_size,
            node_rank=_node_rank_by_blocks(rank, local_rank, local_size),
            launcher="mpich",
        )
    if "SLURM_PROCID" in env and "SLURM_STEP_ID" in env:
        node_id = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        size = _int(env, "SLURM_NTASKS") if "SLURM_NTASKS" in env else _int(env, "SLURM_NPROCS")
        tasks_per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        local_size = _slurm_tasks_on_node(tasks_per_node, node_id) if tasks_per_node else size
        return Environment(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=size,
            local_world_size=local_size,
            node_rank=node_id,
            launcher="slurm",
        )
    if "RANK" in env and "WORLD_SIZE" in env and "LOCAL_RANK" in env:
        rank = _int(env, "RANK")
        size = _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK")
        local_size = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else size
        node = (
            _int(env, "GROUP_RANK")
            if "GROUP_RANK" in env
            else _node_rank_by_blocks(rank, local_rank, local_size)
        )
        return Environment(rank, local_rank, size, local_size, node, "torchrun")
    return Environment(0, 0, 1, 1, 0, "single")


_OPEN_MPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")
_OPEN_MPI_LOCAL = ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")


def open_mpi_variables(env: Environment, base: Mapping[str, str]) -> dict[str, str]:
    """Open MPI's rank variables where another launcher started the rank, for CGX's scripts.

    CGX's scripts and test take rank and size from ``OMPI_COMM_WORLD_RANK`` /
    ``_SIZE`` (asserting "CGX only works with mpirun launch"). Open MPI sets
    them itself, and so may the user: then (any of the four set) nothing is
    added. They are what :func:`environment` reads first, so they
    are exported only where it then reads the same rank, sizes and node: not
    where the node is not the by-blocks one it would compute (Slurm's cyclic
    placement). MPICH and mpi4py do not read them.
    """
    if any(name in base for name in (*_OPEN_MPI, *_OPEN_MPI_LOCAL)):
        return {}
    if env.launcher == "single" or env.node_rank != (env.rank - env.local_rank) // max(
        env.local_world_size, 1
    ):
        return {}
    values = (env.rank, env.world_size, env.local_rank, env.local_world_size)
    return {name: str(v) for name, v in zip((*_OPEN_MPI, *_OPEN_MPI_LOCAL), values, strict=True)}


def address_towards(host: str) -> str:
    """This host's address on the route to ``host``, a name or an address (a UDP
    socket's connect picks the route; no packet is sent).

    Raises:
        OSError: no route to ``host`` (or it has no address).
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((host, 9))
        return str(probe.getsockname()[0])


def slurm_first_node(env: Mapping[str, str]) -> str:
    """The first node of the Slurm job step ``env`` describes (``SLURM_STEP_NODELIST``,
    a hostlist such as ``node[01-04,07]``: ``node01``), where srun starts rank 0;
    "" outside a step.

    Why: mpxrun, started on a login node or outside an allocation, cannot know
    where srun will put rank 0; each rank reads it here.
    """
    nodelist = env.get("SLURM_STEP_NODELIST", "")
    # The first item of the list: up to the first comma outside brackets.
    depth, end = 0, len(nodelist)
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    # Each bracket's first name: "c[1-2]n[3,5]-ib" -> "c1n3-ib".
    return re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], nodelist[:end])


def free_port(host: str = "") -> int:
    """Returns a TCP port that is free on this host right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _agree_on_master(env: Environment) -> tuple[str, str]:
    """Finds MASTER_ADDR/MASTER_PORT every rank agrees on.

    ``mpxrun`` exports ``MPX_MASTER_ADDR``/``MPX_MASTER_PORT``. Under a bare
    ``mpiexec`` rank 0 picks a free port and broadcasts it with mpi4py.
    """
    addr, port = MASTER_ADDR.read(), MASTER_PORT.read()
    if addr and port:
        return addr, port
    if env.world_size == 1:
        return "127.0.0.1", str(free_port("127.0.0.1"))
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchEnvironmentError(
            f"rank {env.rank} of {env.world_size}: cannot agree on MASTER_ADDR/MASTER_PORT; "
            "start the job with mpxrun, set MASTER_ADDR and MASTER_PORT, or pip install mpi4py"
        ) from None
    comm = MPI.COMM_WORLD
    if comm.Get_size() != env.world_size:
        raise LaunchEnvironmentError(
            f"MPI.COMM_WORLD has {comm.Get_size()} ranks but the launcher says {env.world_size}"
        )
    choice = None
    if comm.Get_rank() == 0:
        choice = (socket.gethostname(), str(free_port()))
    addr, port = comm.bcast(choice, root=0)
    return str(addr), str(port)


def init_torch_env(env: Environment | None = None) -> Environment:
    """Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT.

    Variables already set are kept, so a user's MASTER_ADDR wins. After this,
    ``torch.distributed.init_process_group("gloo")`` (``env://``) works under
    ``mpxrun``, ``mpiexec``, ``srun`` or as a single process.

    Args:
        env: the job description; :func:`environment` by default.

    Returns:
        The :class:`Environment` that was exported.

    Example::

        env = init_torch_env()
        torch.distributed.init_process_group("gloo")
        assert torch.distributed.get_rank() == env.rank
    """
    env = environment() if env is None else env
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    os.environ["LOCAL_RANK"] = str(env.local_rank)
    os.environ["LOCAL_WORLD_SIZE"] = str(env.local_world_size)
    os.environ["GROUP_RANK"] = str(env.node_rank)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        addr, port = _agree_on_master(env)
        os.environ.setdefault("MASTER_ADDR", addr)
        os.environ.setdefault("MASTER_PORT", port)
    return env


TORCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""What torch's ``env://`` rendezvous reads."""

MPI_LAUNCHERS = ("openmpi", "mpich", "slurm")
"""The :attr:`Environment.launcher` values of a job that an MPI launcher started."""


def init_torch_env_under_mpi() -> Environment | None:
    """:func:`init_torch_env` where a bare MPI launcher started this process, else nothing.

    For ``init_process_group`` under ``mpiexec`` or ``srun`` with nothing set by
    hand (mpx-collectives calls it from torch's ``env://`` rendezvous). Does
    nothing (None) when every one of :data:`TORCH_VARIABLES` is set already
    (torchrun, mpxrun, the user) or no MPI launcher started this process (a
    plain ``python``: torch's own error about RANK then, as for gloo).

    Example::

        init_torch_env_under_mpi()      # under `mpiexec -n 2`: RANK=0/1, WORLD_SIZE=2, ...
        torch.distributed.init_process_group("gloo")
    """
    if all(name in os.environ for name in TORCH_VARIABLES):
        return None
    found = environment()
    if found.launcher not in MPI_LAUNCHERS:
        return None
    return init_torch_env(found)
