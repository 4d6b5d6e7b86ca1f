"""The supervisor ``mpxrun`` puts around every rank.

The MPI launcher starts ``python -m mpx.launch.rank -- prog args…`` once per
rank; this module starts ``prog`` as its child and watches it::

    mpxrun ── mpiexec ──┬── hydra proxy ── rank supervisor ── prog (rank 0)
                        └── hydra proxy ── rank supervisor ── prog (rank 1)
                                                │
              stderr of prog ──tee──> stderr ───┘ (+ the last lines kept)

When ``prog`` exits, the supervisor writes one status line
(``MPXRUN-RANK-EXITED rank code tail mac``, see :mod:`mpx.launch.status`) to
stderr. The launcher forwards stderr from every node, so ``mpxrun`` learns
which rank failed and why even on a cluster, strips the line, stops the job
and reports it. The line is signed with the job's key (``MPX_STATUS_KEY``),
which the supervisor keeps from ``prog``: nothing ``prog`` prints can pass
for a status line.

On SIGUSR1 (``mpxrun --timeout`` sends it) the supervisor asks ``prog`` for
its Python stack (:mod:`mpx.launch.stacks`) and sends it to ``mpxrun`` the
same way (``MPXRUN-RANK-STACK``).

Nothing is left behind: the child dies with its supervisor (``PR_SET_PDEATHSIG``)
and a supervisor that is told to stop (SIGTERM/SIGINT/SIGHUP) passes the
signal on and kills the child after a grace period.

Per rank it also sets ``OMP_NUM_THREADS`` (cores per local rank),
``CUDA_VISIBLE_DEVICES`` (one GPU per local rank, round robin) and torchrun's
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ...)
unless the user has set them.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import IO

from mpx.launch import binding, stacks
from mpx.launch.environment import Environment, environment
from mpx.launch.settings import (
    BIND,
    GPUS,
    MASTER_ADDR,
    MASTER_PORT,
    STACK_FILE,
    STATUS_KEY,
    TORCH_ENV,
)
from mpx.launch.status import format_status

__all__ = [
    "die_with_parent",
    "main",
    "rank_environment",
    "torchrun_variables",
    "usable_cores",
]

TAIL_LINES = 20
KILL_GRACE_S = 2.0
_PR_SET_PDEATHSIG = 1


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask; all of them off Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _gpu_count() -> int:
    # The driver lists one directory per GPU; reading it costs nothing, unlike
    # starting nvidia-smi or initialising CUDA in the supervisor.
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def rank_environment(
    env: Environment, base: Mapping[str, str], gpus: str = "auto", gpu_count: int | None = None
) -> dict[str, str]:
    """The environment a rank's program runs with.

    Args:
        env: the rank's place in the job.
        base: the inherited environment.
        gpus: ``"auto"`` (one GPU per local rank, round robin) or ``"none"``
            (hide GPUs).
        gpu_count: GPUs on this node; read from the driver when None.
    """
    out = dict(base)
    # The program must not be able to sign status lines (see mpx.launch.status).
    out.pop(STATUS_KEY.name, None)
    if "OMP_NUM_THREADS" not in out:
        cores = usable_cores()
        out["OMP_NUM_THREADS"] = str(max(1, cores // max(env.local_world_size, 1)))
    if gpus == "none":
        out["CUDA_VISIBLE_DEVICES"] = ""
    elif "CUDA_VISIBLE_DEVICES" in base:
        visible = [d for d in base["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
        if len(visible) > 1:
            out["CUDA_VISIBLE_DEVICES"] = visible[env.local_rank % len(visible)]
    else:
        count = _gpu_count() if gpu_count is None else gpu_count
        if count > 0:
            out["CUDA_VISIBLE_DEVICES"] = str(env.local_rank % count)
    out.update(torchrun_variables(env, base))
    return out


def torchrun_variables(env: Environment, base: Mapping[str, str]) -> dict[str, str]:
    """torchrun's variables for this rank, so a torchrun-style script runs under mpxrun.

    ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, and ``MASTER_ADDR``/``MASTER_PORT`` from mpxrun's
    rendezvous point: ``init_process_group(backend)`` with its default
    ``env://`` then needs nothing else. Variables the user set are kept; the
    names exported are listed in ``MPX_TORCH_ENV`` (an mpxrun started inside
    the job replaces them rather than taking them for the user's).
    """
    wanted = {
        "RANK": env.rank,
        "WORLD_SIZE": env.world_size,
        "LOCAL_RANK": env.local_rank,
        "LOCAL_WORLD_SIZE": env.local_world_size,
        "GROUP_RANK": env.node_rank,
        "MASTER_ADDR": base.get(MASTER_ADDR.name, ""),
        "MASTER_PORT": base.get(MASTER_PORT.name, ""),
    }
    out = {name: str(value) for name, value in wanted.items() if name not in base and value != ""}
    out[TORCH_ENV.name] = ",".join(sorted(out))
    return out


def die_with_parent(sig: int) -> None:
    """Asks Linux to send ``sig`` to this process when its parent dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launcher's cleanup has to do
        pass


def _pass_fds() -> tuple[int, ...]:
    # Hydra and gforker hand each rank its PMI connection as an inherited descriptor.
    fd = os.environ.get("PMI_FD", "")
    return (int(fd),) if fd.isdigit() else ()


class _Reporter:
    """Writes this rank's signed status lines to stderr, one whole line at a time."""

    def __init__(self, rank: int, key: str, sink: IO[bytes]) -> None:
        self.rank, self.key, self.sink = rank, key, sink
        self._lock = threading.Lock()
        self._mid_line = False

    def write(self, data: bytes) -> None:
        with self._lock:
            self.sink.write(data)
            self.sink.flush()
            if data:
                self._mid_line = not data.endswith(b"\n")

    def report(self, kind: str, value: int, lines: Sequence[str]) -> None:
        # Without a key this supervisor was not started by mpxrun: nobody listens.
        if self.key:
            line = format_status(self.key, kind, self.rank, value, lines) + "\n"
            # mpxrun drops the whole line a status is found in: a status must
            # not end the program's last line when that lacks its newline.
            self.write(("\n" if self._mid_line else "").encode() + line.encode())


def _tee(source: IO[bytes], sink: _Reporter, tail: collections.deque[str]) -> None:
    for line in iter(source.readline, b""):
        sink.write(line)
        tail.append(line.decode(errors="replace").rstrip("\n"))
    source.close()


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one rank's program under supervision; returns its exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        print("mpx.launch.rank: no program given", file=sys.stderr)
        return 2
    die_with_parent(signal.SIGTERM)
    env = environment()
    reporter = _Reporter(env.rank, STATUS_KEY.read(), sys.stderr.buffer)
    child_env = rank_environment(env, os.environ, gpus=GPUS.read())
    # A file in memory, reached by the program through this process's fd
    # table: nothing is left on disk however the job ends.
    dump_fd = os.memfd_create("mpxrun-stack")
    try:
        stack_file = f"/proc/{os.getpid()}/fd/{dump_fd}"
        child_env[STACK_FILE.name] = stack_file
        return _supervise(args, env, child_env, reporter, stack_file)
    finally:
        os.close(dump_fd)


def _supervise(
    args: list[str],
    env: Environment,
    child_env: dict[str, str],
    reporter: _Reporter,
    stack_file: str,
) -> int:
    level = BIND.read()
    cpus = binding.cpus_for(level, env.local_rank) if level != "none" else None

    def preexec() -> None:
        die_with_parent(signal.SIGKILL)
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

    try:
        child = subprocess.Popen(
            args,
            env=child_env,
            stderr=subprocess.PIPE,
            pass_fds=_pass_fds(),
            preexec_fn=preexec,  # noqa: PLW1509 (no threads run yet)
        )
    except OSError as exc:
        message = f"rank {env.rank}: cannot start {args[0]!r}: {exc.strerror}"
        print(message, file=sys.stderr, flush=True)
        reporter.report("EXITED", 127, [message])
        return 127

    stopped_by: list[int] = []

    def kill_child() -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGKILL)

    def stop(signum: int, _frame: FrameType | None) -> None:
        # Runs in the main thread while it sits in child.wait(), which holds
        # Popen's wait lock: so signal by pid and let wait() see the end.
        if not stopped_by:
            stopped_by.append(signum)
            timer = threading.Timer(KILL_GRACE_S, kill_child)
            timer.daemon = True
            timer.start()
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)

    def send_stack() -> None:
        reporter.report("STACK", child.pid, stacks.dump(child.pid, stack_file))

    def stack_requested(_signum: int, _frame: FrameType | None) -> None:
        # Waiting for the dump would block the handler: a thread does it.
        threading.Thread(target=send_stack, daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    signal.signal(stacks.DUMP_SIGNAL, stack_requested)

    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    assert child.stderr is not None
    reader = threading.Thread(target=_tee, args=(child.stderr, reporter, tail), daemon=True)
    reader.start()
    code = child.wait()
    # A grandchild may still hold the pipe open; don't wait for it forever.
    reader.join(timeout=2.0)
    if stopped_by:
        # Stopped from outside (mpxrun, the launcher, Ctrl-C): not this rank's fault.
        return 128 + stopped_by[0]
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        tail.append(f"(rank {env.rank} was killed by {name})")
    reporter.report("EXITED", code, list(tail) if code != 0 else [])
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
