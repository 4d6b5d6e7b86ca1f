"""Finding the installed MPI launcher and speaking its dialect.

``mpxrun`` translates one set of options into the command line and the
environment of whichever launcher is there::

    mpxrun option      MPICH (Hydra)      Open MPI (mpirun)     Slurm (srun)
    -----------------  -----------------  --------------------  ------------------
    -n N               -n N               -n N                  -n N
    --hostfile F       -f F               --hostfile F          (the allocation)
    --bind core|numa   -bind-to core|numa --bind-to core|numa   --cpu-bind=cores|ldoms
    --tag-output       -prepend-rank      --tag-output          --label
    (one rank fails)   (Hydra stops all)  (mpirun stops all)    --kill-on-bad-exit=1
    environment        inherited          -x NAME for each      inherited

Oversubscription (more ranks than cores) makes MPICH busy-poll and Open MPI
refuse to start; the defaults below make both yield instead. A variable the
user has already set is never overridden.

A job whose ranks all run on this host listens on loopback only: its MPI
transports are pinned to ``lo`` (MPICH: ``UCX_NET_DEVICES``, ``FI_TCP_IFACE``;
Open MPI: ``btl_tcp_if_include``, ``oob_tcp_if_include``), and MPICH's ranks
are started by ``mpiexec.gforker`` (:meth:`Launcher.on_this_host`), which
forks them and speaks PMI over socket pairs, where Hydra's ``mpiexec``
listens for its proxies on a TCP port of every interface. gforker cuts output
at the first non-ASCII byte and cannot bind: the ranks' output bypasses it
(``MPX_OUTPUT_FDS``) and for ``--bind`` the rank supervisor pins its program
itself (``MPX_BIND``, :mod:`mpx.launch.rank.binding`). Under MPICH the supervisors
tag output lines (``MPX_TAG_OUTPUT``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mpx.launch.errors import LauncherNotFound, UsageError
from mpx.launch.settings import LAUNCHER

__all__ = ["BIND_CHOICES", "LAUNCHER_KINDS", "Launcher", "find_launcher"]

LAUNCHER_KINDS = ("mpich", "openmpi", "slurm")
BIND_CHOICES = ("none", "core", "numa")

# MPICH's settings for oversubscribed nodes, as mpi4py's own CI uses them:
# poll once, then yield the core to another rank.
_MPICH_YIELD = {
    "MPIR_CVAR_POLLS_BEFORE_YIELD": "1",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE": "true",
    "MPIR_CVAR_CH4_PROGRESS_THROTTLE_NO_PROGRESS_COUNT": "1",
}
# Every transport on loopback: what a job confined to this host needs, and
# nothing another machine can reach. UCX is MPICH's default netmod, OFI/tcp
# its other (FI_PROVIDER=tcp below).
_MPICH_LOOPBACK = {"UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo"}
_OPENMPI_LOOPBACK = {
    "OMPI_MCA_btl_tcp_if_include": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "PRTE_MCA_oob_tcp_if_include": "lo",
}
_GFORKER = "mpiexec.gforker"
# Below this much free /dev/shm MPICH dies with bus errors; NOLOCAL routes
# intra-node traffic through the network module instead.
_MIN_DEV_SHM_BYTES = 256 << 20

_SLURM_BIND = {"none": "none", "core": "cores", "numa": "ldoms"}

_INSTALL_HINT = "pip install mpi4py mpich (or load your cluster's MPI module)"


@dataclass(frozen=True)
class Launcher:
    """An MPI launcher found on this machine.

    Attributes:
        kind: ``"mpich"``, ``"openmpi"`` or ``"slurm"``.
        path: the executable (``mpiexec``, ``mpirun`` or ``srun``).
        forker: ``path`` is MPICH's ``mpiexec.gforker``, which starts ranks
            on this host only (see :meth:`on_this_host`).

    Example::

        launcher = find_launcher()
        cmd = launcher.command(2, ["python", "train.py"])
        env = launcher.environment(2, oversubscribed=True)
    """

    kind: str
    path: str
    forker: bool = False

    def on_this_host(self) -> Launcher:
        """The launcher for a job whose ranks all run on this host.

        For MPICH, the ``mpiexec.gforker`` installed beside ``mpiexec`` if
        there is one: it forks the ranks and speaks PMI over socket pairs,
        where Hydra listens for its proxies on a TCP port of every interface.
        gforker cuts a rank's output at the first byte that is not ASCII
        (``print("a – b")`` arrives as ``a``), so under it the ranks' output
        does not pass through it (``Job.own_output``). Otherwise this launcher.

        (A gloo job's abort at exit, "terminate called without an active
        exception", once blamed on gforker, is torch's: 6 of 24 runs of a
        gloo script under torchrun itself, and under Hydra too.)
        """
        if self.kind != "mpich" or self.forker:
            return self
        beside = Path(self.path).resolve().parent / _GFORKER
        if beside.is_file() and os.access(beside, os.X_OK):
            return Launcher("mpich", str(beside), forker=True)
        return self

    def command(
        self,
        nprocs: int,
        program: Sequence[str],
        *,
        hostfile: str | None = None,
        bind: str = "none",
        tag_output: bool = False,
        export: Sequence[str] = (),
    ) -> list[str]:
        """The command line that starts ``nprocs`` copies of ``program``.

        Args:
            nprocs: number of ranks.
            program: the program and its arguments.
            hostfile: a file of hosts, one per line (``host`` or ``host:slots``).
            bind: ``"none"``, ``"core"`` or ``"numa"``.
            tag_output: prefix each output line with its rank.
            export: names of variables to pass to the ranks explicitly (Open
                MPI does not forward the environment by default).
        """
        if bind not in BIND_CHOICES:
            raise UsageError(f"--bind must be one of {', '.join(BIND_CHOICES)}, got {bind!r}")
        cmd = [self.path, "-n", str(nprocs)]
        if self.forker:
            # Binding is the rank supervisor's job here (MPX_BIND, mpx.launch.rank.binding).
            # So are tags (MPX_TAG_OUTPUT): the ranks' output bypasses gforker.
            if hostfile:
                raise UsageError(
                    f"{self.path} starts ranks on this host only: --hostfile needs Hydra's mpiexec"
                )
        elif self.kind == "mpich":
            if hostfile:
                cmd += ["-f", hostfile]
            if bind != "none":
                cmd += ["-bind-to", bind]
            # No -prepend-rank: Hydra tags each write, so a line printed in two
            # writes came out "[0] é[0]  0"; the supervisors tag whole lines
            # (MPX_TAG_OUTPUT).
        elif self.kind == "openmpi":
            if hostfile:
                cmd += ["--hostfile", hostfile]
            cmd += ["--bind-to", bind]
            if tag_output:
                cmd += ["--tag-output"]
            for name in export:
                cmd += ["-x", name]
        else:
            if hostfile:
                raise UsageError(
                    "--hostfile cannot be used with srun: Slurm places ranks on the "
                    "nodes of the allocation (use salloc/sbatch --nodes instead)"
                )
            # Slurm ends the whole step when a task fails, on every node, even
            # where mpxrun's signals to srun's session do not reach: with
            # --max-restarts the next attempt's step then starts on free nodes.
            if bind != "none":
                # Only when asked: a cluster without a task plugin warns at every
                # --cpu-bind, even "none".
                cmd += [f"--cpu-bind={_SLURM_BIND[bind]}"]
            cmd += ["--kill-on-bad-exit=1"]
            if _slurm_mpi_default_is_none():
                # srun then gives the ranks no PMI, and each MPI process is a world of
                # its own (the selftest: "the launcher says rank 1 of 2, MPI says 0 of
                # 1"). PMI-2 is what MPICH (mpx's default MPI), Intel MPI and MVAPICH
                # speak; SLURM_MPI_TYPE or a cluster default (pmix for Open MPI) wins.
                cmd += ["--mpi=pmi2"]
            if tag_output:
                cmd += ["--label"]
        return cmd + list(program)

    def environment(
        self, nprocs: int, *, oversubscribed: bool, local: bool = True
    ) -> dict[str, str]:
        """Variables this launcher needs for a sane run, user settings excluded.

        Args:
            nprocs: number of ranks.
            oversubscribed: more ranks than cores on a node.
            local: all ranks on this machine (no hostfile, no Slurm).
        """
        env: dict[str, str] = {}
        if self.kind == "mpich":
            if oversubscribed:
                env.update(_MPICH_YIELD)
            if local:
                # Start local ranks by fork instead of through ssh.
                env["HYDRA_LAUNCHER"] = "fork"
                env["FI_PROVIDER"] = "tcp"
                env.update(_MPICH_LOOPBACK)
            if _dev_shm_free() < _MIN_DEV_SHM_BYTES:
                env["MPIR_CVAR_NOLOCAL"] = "1"
        elif self.kind == "openmpi":
            if local:
                env.update(_OPENMPI_LOOPBACK)
            if oversubscribed:
                env["OMPI_MCA_mpi_yield_when_idle"] = "1"
                env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
                env["OMPI_MCA_rmaps_base_oversubscribe"] = "1"
            if hasattr(os, "geteuid") and os.geteuid() == 0:
                env["OMPI_ALLOW_RUN_AS_ROOT"] = "1"
                env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
        return env


def _dev_shm_free() -> int:
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return 1 << 62  # no /dev/shm to worry about
    return stat.f_bavail * stat.f_frsize


def _identify(path: str) -> str | None:
    """Asks an ``mpiexec``/``mpirun`` which MPI it belongs to."""
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    text = out.stdout + out.stderr
    if "HYDRA" in text or "MPICH" in text or "Intel(R) MPI" in text:
        return "mpich"
    if "Open MPI" in text or "OpenRTE" in text or "prte" in text.lower():
        return "openmpi"
    return None


def _candidates(env: Mapping[str, str]) -> list[str]:
    # The launcher next to this interpreter first: `pip install mpich` puts
    # mpiexec into the environment's bin/, which need not be on PATH.
    found: list[str] = []
    here = Path(sys.executable).parent
    search_path = env.get("PATH", os.defpath)
    for name in ("mpiexec", "mpirun"):
        beside = here / name
        if beside.is_file() and os.access(beside, os.X_OK):
            found.append(str(beside))
        on_path = shutil.which(name, path=search_path)
        if on_path:
            found.append(on_path)
    return list(dict.fromkeys(found))


def _slurm_mpi_default_is_none(env: Mapping[str, str] | None = None) -> bool:
    """Whether srun would start the ranks without PMI: no SLURM_MPI_TYPE and the
    cluster's ``MpiDefault`` is ``none`` (``scontrol show config``; False if unknown)."""
    env = os.environ if env is None else env
    if env.get("SLURM_MPI_TYPE") or not shutil.which("scontrol"):
        return False
    try:
        shown = subprocess.run(
            ["scontrol", "show", "config"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    for line in shown.splitlines():
        name, _, value = line.partition("=")
        if name.strip() == "MpiDefault":
            return value.strip().lower() == "none"
    return False


def find_launcher(kind: str = "auto", env: Mapping[str, str] | None = None) -> Launcher:
    """Finds the MPI launcher to use.

    Args:
        kind: ``"auto"`` (``srun`` inside a Slurm allocation, else the
            ``mpiexec`` beside this Python, else the first on ``PATH``), one of
            ``"mpich"``, ``"openmpi"``, ``"slurm"``, or a path to a launcher.
            ``MPX_LAUNCHER`` sets it too.
        env: the environment to search; ``os.environ`` by default.

    Raises:
        LauncherNotFound: nothing suitable is installed.
    """
    env = os.environ if env is None else env
    if kind == "auto":
        kind = LAUNCHER.read(env)
    if kind not in ("auto", *LAUNCHER_KINDS):
        identified = _identify(kind)
        if identified is None:
            raise LauncherNotFound(
                f"launcher {kind!r} is not an MPICH or Open MPI mpiexec/mpirun; "
                "pass --launcher auto|mpich|openmpi|slurm"
            )
        return Launcher(identified, kind)
    if kind in ("auto", "slurm"):
        srun = shutil.which("srun", path=env.get("PATH", os.defpath))
        if srun and (kind == "slurm" or "SLURM_JOB_ID" in env):
            return Launcher("slurm", srun)
        if kind == "slurm":
            raise LauncherNotFound("--launcher slurm, but srun is not on PATH")
    for path in _candidates(env):
        identified = _identify(path)
        if identified is not None and kind in ("auto", identified):
            return Launcher(identified, path)
    wanted = "MPI launcher" if kind == "auto" else f"{kind} launcher"
    raise LauncherNotFound(
        f"no {wanted} found (looked for mpiexec and mpirun beside {sys.executable} "
        f"and on PATH); {_INSTALL_HINT}"
    )
