"""The supervisor ``mpxrun`` puts around every rank.

The MPI launcher starts ``python -m mpx.launch.rank -- prog args…`` once per
rank; this module starts ``prog`` as its child and watches it::

    mpxrun ── mpiexec ──┬── hydra proxy ── rank supervisor ── prog (rank 0)
                        └── hydra proxy ── rank supervisor ── prog (rank 1)
                                                │
              stderr of prog ──tee──> stderr ───┘ (+ the last lines kept)

When ``prog`` exits, the supervisor writes one status line
(``MPXRUN-RANK-EXITED rank code tail mac``, see :mod:`mpx.launch.rank.status`) to
stderr. Under MPICH's gforker (single-host jobs), "stdout" and "stderr" are
two descriptors mpxrun handed down (``MPX_OUTPUT_FDS``), since gforker cuts
output at the first non-ASCII byte. The launcher forwards stderr from every
node, so ``mpxrun`` learns which rank failed and why even on a cluster,
strips the line, stops the job and reports it. The line is signed with the
job's key (``MPX_STATUS_KEY``), which the supervisor keeps from ``prog``:
nothing ``prog`` prints can pass for a status line.

On SIGUSR1 (``mpxrun --timeout`` sends it) the supervisor asks ``prog`` for
its Python stack (:mod:`mpx.launch.hook.stacks`) and sends it to ``mpxrun`` the
same way (``MPXRUN-RANK-STACK``).

A Python ``prog`` says on a pipe of the supervisor (``MPX_END_FILE``, see
:mod:`mpx.launch.excepthook`) that it started and, later, that it reached its
end. The supervisor passes the end on at once (``MPXRUN-RANK-ENDED``: the rank
may still sit in ``MPI_Finalize``, waiting for the others), and reports an
exit code 0 without that end as ``MPXRUN-RANK-LEFT``: the program left in the
middle (``os._exit(0)``), which ``mpxrun`` judges against the other ranks.

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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import IO

from mpx.launch import hook
from mpx.launch.environment import (
    Environment,
    environment,
    open_mpi_variables,
    slurm_first_node,
)
from mpx.launch.rank import binding
from mpx.launch.rank.status import format_status
from mpx.launch.settings import (
    BIND,
    END_FILE,
    GPUS,
    MASTER_ADDR,
    MASTER_PORT,
    OUTPUT_FDS,
    STACK_FILE,
    STATUS_KEY,
    TAG_OUTPUT,
    TORCH_ENV,
)

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
    # The program must not be able to sign status lines (see mpx.launch.rank.status).
    out.pop(STATUS_KEY.name, None)
    # The supervisor's channels, not the program's: an mpxrun the program
    # starts would hand them to its own ranks.
    out.pop(OUTPUT_FDS.name, None)
    out.pop(TAG_OUTPUT.name, None)
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
    ``env://`` then needs nothing else. Open MPI's ``OMPI_COMM_WORLD_*`` too
    (:func:`open_mpi_variables`), which CGX's scripts read. Variables the user set are kept; the
    names exported are listed in ``MPX_TORCH_ENV`` (an mpxrun started inside
    the job replaces them rather than taking them for the user's).
    """
    wanted = {
        "RANK": env.rank,
        "WORLD_SIZE": env.world_size,
        "LOCAL_RANK": env.local_rank,
        "LOCAL_WORLD_SIZE": env.local_world_size,
        "GROUP_RANK": env.node_rank,
        # Under srun mpxrun leaves the address to the ranks: rank 0's node is the step's first.
        "MASTER_ADDR": base.get(MASTER_ADDR.name, "") or slurm_first_node(base),
        "MASTER_PORT": base.get(MASTER_PORT.name, ""),
    }
    out = {name: str(value) for name, value in wanted.items() if name not in base and value != ""}
    out.update(open_mpi_variables(env, base))
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


def _tee(
    source: IO[bytes], sink: _Reporter, tail: collections.deque[str], tag: bytes = b""
) -> None:
    for line in iter(source.readline, b""):
        sink.write(tag + line)
        tail.append(line.decode(errors="replace").rstrip("\n"))
    source.close()


def _copy_lines(source: IO[bytes], sink: IO[bytes], tag: bytes) -> None:
    for line in iter(source.readline, b""):
        sink.write(tag + line)
        sink.flush()
    source.close()


@dataclass(frozen=True)
class _Output:
    """Where this rank's program writes, and the supervisor's status lines go.

    Under Hydra (and mpirun, srun) both are the supervisor's own stdout and
    stderr, which the launcher forwards. Under MPICH's gforker, which cuts
    output at the first byte that is not ASCII, mpxrun hands every
    supervisor two descriptors of its own (``MPX_OUTPUT_FDS``): the program
    writes to mpxrun's stdout directly, and its stderr and the status lines
    go to a pipe mpxrun reads. ``tag``: the prefix of each line where the
    launcher does not tag (``MPX_TAG_OUTPUT``).
    """

    stdout: int | None
    stderr: IO[bytes]
    tag: bytes

    @property
    def copies_stdout(self) -> bool:
        """The supervisor passes the program's stdout on line by line.

        Needed to tag lines, and on a descriptor shared by all ranks: their
        unbuffered writes (``print`` writes text and newline apart) would
        interleave mid-line, where a launcher forwards each rank's lines whole.
        """
        return bool(self.tag) or self.stdout is not None

    @classmethod
    def for_rank(cls, rank: int) -> _Output:
        tag = f"[{rank}] ".encode() if TAG_OUTPUT.read() else b""
        fds = OUTPUT_FDS.read()
        if not fds:
            return cls(None, sys.stderr.buffer, tag)
        out, err = (int(fd) for fd in fds.split(","))
        return cls(out, os.fdopen(err, "wb"), tag)


class _EndWatch:
    """Reads what the program says on the end channel: that it started, that it ended.

    Lines are ``A <pid>`` (a Python program with mpx's hook started) and
    ``E <pid> <code>`` (it reached its end, exiting with ``code``); only those
    of the supervisor's own child count (programs it starts open the channel
    too, through the inherited variable).
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd
        self.pid = 0
        self.armed = False
        self.ended: int | None = None
        self.on_end: list[Callable[[int], None]] = []
        self._thread = threading.Thread(target=self._read, daemon=True)

    def start(self, pid: int) -> None:
        self.pid = pid
        self._thread.start()

    def _read(self) -> None:
        with os.fdopen(self.read_fd, "rb") as source:
            for raw in iter(source.readline, b""):
                words = raw.split()
                if len(words) < 2 or words[1] != str(self.pid).encode():
                    continue
                if words[0] == b"A":
                    self.armed = True
                elif words[0] == b"E" and len(words) == 3 and self.ended is None:
                    self.ended = int(words[2]) if words[2].lstrip(b"-").isdigit() else 1
                    for callback in self.on_end:
                        callback(self.ended)

    def finish(self) -> None:
        """After the program exited: reads what is left of the channel."""
        os.close(self.write_fd)
        # A program the rank started may still hold the channel open.
        self._thread.join(timeout=2.0)


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
    output = _Output.for_rank(env.rank)
    reporter = _Reporter(env.rank, STATUS_KEY.read(), output.stderr)
    child_env = rank_environment(env, os.environ, gpus=GPUS.read())
    # A file in memory, reached by the program through this process's fd
    # table: nothing is left on disk however the job ends.
    dump_fd = os.memfd_create("mpxrun-stack")
    # The program opens the pipe's write end by this path; the supervisor
    # keeps it open until the program has exited, so the path stays valid.
    end_read, end_write = os.pipe()
    try:
        stack_file = f"/proc/{os.getpid()}/fd/{dump_fd}"
        child_env[STACK_FILE.name] = stack_file
        child_env[END_FILE.name] = f"/proc/{os.getpid()}/fd/{end_write}"
        end = _EndWatch(end_read, end_write)
        return _supervise(args, env, child_env, reporter, stack_file, output, end)
    finally:
        os.close(dump_fd)


def _supervise(
    args: list[str],
    env: Environment,
    child_env: dict[str, str],
    reporter: _Reporter,
    stack_file: str,
    output: _Output,
    end: _EndWatch,
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
            stdout=subprocess.PIPE if output.copies_stdout else None,
            stderr=subprocess.PIPE,
            pass_fds=_pass_fds(),
            preexec_fn=preexec,  # noqa: PLW1509 (no threads run yet)
        )
    except OSError as exc:
        message = f"rank {env.rank}: cannot start {args[0]!r}: {exc.strerror}"
        reporter.write(output.tag + message.encode() + b"\n")
        reporter.report("EXITED", 127, [message])
        return 127
    end.on_end.append(lambda code: reporter.report("ENDED", code, []))
    end.start(child.pid)

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
        if end.ended is not None and not hook.handles_dump_signal(child.pid):
            # Python has shut down its signal handlers: the program is over,
            # the process not yet (MPI_Finalize waits for every rank).
            lines = [
                f"(no Python stack: rank {env.rank} had already finished its program, "
                f"exit code {end.ended}; it is waiting to exit, e.g. in MPI_Finalize for "
                "the other ranks)"
            ]
        else:
            lines = hook.dump(child.pid, stack_file)
        reporter.report("STACK", child.pid, lines)

    def stack_requested(_signum: int, _frame: FrameType | None) -> None:
        # Waiting for the dump would block the handler: a thread does it.
        threading.Thread(target=send_stack, daemon=True).start()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, stop)
    signal.signal(hook.DUMP_SIGNAL, stack_requested)

    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    assert child.stderr is not None
    readers = [
        threading.Thread(target=_tee, args=(child.stderr, reporter, tail, output.tag), daemon=True)
    ]
    if child.stdout is not None:  # whole lines, tagged if asked
        stdout = sys.stdout.buffer if output.stdout is None else os.fdopen(output.stdout, "wb")
        readers.append(
            threading.Thread(
                target=_copy_lines, args=(child.stdout, stdout, output.tag), daemon=True
            )
        )
    for reader in readers:
        reader.start()
    code = child.wait()
    # No stack to give any more; and SIGUSR1's default action would kill this
    # supervisor once Python restores it at exit, which launchers report.
    signal.signal(hook.DUMP_SIGNAL, signal.SIG_IGN)
    end.finish()
    # A grandchild may still hold a pipe open; don't wait for it forever.
    for reader in readers:
        reader.join(timeout=2.0)
    if stopped_by:
        # Stopped from outside (mpxrun, the launcher, Ctrl-C): not this rank's fault.
        return 128 + stopped_by[0]
    if code == 0 and end.armed and end.ended is None:
        # Exit code 0, but Python never shut down: os._exit(0) or an exit from C.
        reporter.report("LEFT", 0, list(tail))
        return 0
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
