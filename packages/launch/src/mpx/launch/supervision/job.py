"""The job ``mpxrun`` supervises: one launcher process, its ranks' reports, and the verdict.

A :class:`Job` runs the launcher in a session of its own and reads the
status lines the rank supervisors sign (:mod:`mpx.launch.rank.status`): which
ranks exited how, which ended their program; it stops the whole job on the
first failure, at ``--timeout`` (after collecting the ranks' stacks,
:mod:`mpx.launch.hook.stacks`) or when the ranks still running wait for ones that
ended early. :mod:`mpx.launch.supervision.outcome` runs the attempts ``--max-restarts``
allows and says how the last one ended. :mod:`mpx.launch.cli` builds the job
from the command line.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO

from mpx.launch import hook, settings
from mpx.launch.rank import die_with_parent, parse_status

__all__ = [
    "EXIT_ENDED_EARLY",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "Job",
    "RankFailure",
    "ranks_phrase",
]

# After the first failure the launcher gets this long to stop the other ranks
# itself (Hydra and mpirun do) before mpxrun signals them.
LAUNCHER_GRACE_S = 1.0
# Between SIGTERM and SIGKILL.
TERM_GRACE_S = 2.0
# After every rank reported a clean exit, how long a launcher that is done
# but lingers (see Job.end_when_ranks_exit) may take before it is stopped:
# none. A supervisor's exit status is its last act, so nothing is left to wait
# for, and gforker would mostly sit out its 2 s (issue 59: mpxrun's start-up).
LINGER_S = 0.0
# How often Job.run looks at the clock (--timeout, the watch of the ranks left)
# when no status line arrives; a status line wakes it at once.
POLL_S = 0.02
# At --timeout, how long the ranks get to send their stacks.
STACKS_WAIT_S = hook.DUMP_WAIT_S + 1.0
# After a rank left mid-program with exit code 0 (os._exit(0)), how long the
# others have to end too before the job counts as failed: ranks that all
# leave this way at the very end (a common way round exit-time aborts in
# torch) finish a moment apart, seconds on a loaded machine.
LEFT_WINDOW_S = 10.0
# Exit code of a job that failed although every rank it heard from exited 0.
EXIT_ENDED_EARLY = 1
EXIT_TIMEOUT = 124
# Exit code of bad usage, found before anything starts (mpxrun's, or the program's:
# outcome.usage_error).
EXIT_USAGE = 2


@dataclass
class RankFailure:
    """A rank that exited non-zero or was killed, or that ended the job early.

    Attributes:
        rank: the rank.
        code: its exit code (negative: the signal that killed it).
        tail: the last lines of its stderr.
        reason: set when the exit code alone is not the failure: what the
            rank did wrong (it then fails the job with code 1).
        details: more lines for the report (the stacks of the ranks waiting).
    """

    rank: int
    code: int
    tail: list[str]
    reason: str = ""
    details: list[str] = field(default_factory=list)
    ended_before: list[int] = field(default_factory=list)

    def describe(self) -> str:
        if self.reason:
            return self.reason
        if self.code < 0:
            try:
                how = f"was killed by {signal.Signals(-self.code).name}"
            except ValueError:
                how = f"was killed by signal {-self.code}"
        else:
            how = f"exited with code {self.code}"
        return f"rank {self.rank} {how}"

    @property
    def exit_code(self) -> int:
        if self.reason:
            return EXIT_ENDED_EARLY
        return self.code if self.code > 0 else 128 - self.code


def ranks_phrase(ranks: Sequence[int]) -> str:
    """``"rank 3"`` or ``"ranks 1, 2"``, for mpxrun's messages."""
    return ("ranks " if len(ranks) > 1 else "rank ") + ", ".join(map(str, ranks))


@dataclass
class _Progress:
    """What the watch of the ranks still running saw of one of them."""

    point: hook.WaitPoint | None
    since: float
    stack: list[str]


@dataclass
class Job:
    """A running launcher process and what its ranks reported.

    Example::

        key = new_key()
        env = dict(os.environ, MPX_STATUS_KEY=key)
        job = Job(["mpiexec", "-n", "2", "python", "-m", "mpx.launch.rank", "--", "hostname"],
                  env=env, status_key=key, nprocs=2)
        code = job.run(timeout=60)
        print(job.failures)

    Attributes:
        status_key: the key the supervisors sign status lines with; lines
            not signed with it are ordinary output.
        nprocs: the number of ranks (0: unknown).
        local: every rank runs on this host (so ``mpxrun`` can signal their
            supervisors itself rather than through the launcher).
        launcher_lingers: the launcher is MPICH's gforker, which waits 2 s
            after its last rank more often than not (its MPIE_WaitForProcesses
            counts a live rank again on every pass, so one live rank at the
            first look makes it sit out its timeout), and does not stop the
            other ranks when one fails. When stopping the job, ``mpxrun``
            waits for the local rank supervisors to end, not for it, and gives
            it no grace after a failure.
        end_when_ranks_exit: once every rank has reported exit code 0, stop
            the launcher instead of waiting for it (for a lingering launcher;
            only safe where the ranks' output does not pass through it).
        own_output: the ranks' output bypasses the launcher (gforker, which
            cuts it at the first non-ASCII byte): the supervisors get mpxrun's
            stdout and a pipe to its stderr reader as ``MPX_OUTPUT_FDS``.
    """

    command: list[str]
    # The whole environment goes to the ranks, as the launcher code's (cli's) does.
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    stderr: IO[bytes] = field(default_factory=lambda: sys.stderr.buffer)
    status_key: str = ""
    nprocs: int = 0
    local: bool = True
    launcher_lingers: bool = False
    end_when_ranks_exit: bool = False
    own_output: bool = False
    end_grace: float = 30.0
    failures: list[RankFailure] = field(default_factory=list)
    exited: dict[int, int] = field(default_factory=dict)
    ended: dict[int, int] = field(default_factory=dict)
    stacks: dict[int, list[str]] = field(default_factory=dict)
    timed_out: bool = False
    # Set from another thread to stop the job (mpxrun --replica-groups stops every group's).
    cancel: threading.Event = field(default_factory=threading.Event)
    _failed: threading.Event = field(default_factory=threading.Event)
    # Set by the status reader on every status line: Job.run's loop looks at once.
    _news: threading.Event = field(default_factory=threading.Event)
    _left: dict[int, tuple[float, list[str]]] = field(default_factory=dict)
    _first_end: float | None = None
    _progress: dict[int, _Progress] = field(default_factory=dict)
    _sampled_at: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _pump(self, source: IO[bytes]) -> None:
        for raw in iter(source.readline, b""):
            status = parse_status(self.status_key, raw.decode(errors="replace"))
            if status is None:
                self.stderr.write(raw)
                self.stderr.flush()
                continue
            with self._lock:
                self._record(status.kind, status.rank, status.value, status.lines)
            self._news.set()
        source.close()
        self._news.set()  # the end of the launcher's stderr: mostly, the launcher's end

    def _record(self, kind: str, rank: int, value: int, lines: list[str]) -> None:
        now = time.monotonic()
        if kind == "STACK":
            self.stacks[rank] = lines
            self._note_progress(rank, lines, now)
            return
        if kind == "ENDED":
            self.ended[rank] = value
        elif kind == "LEFT":
            self.exited[rank] = 0
            self._left[rank] = (now, lines)
        else:
            self.exited[rank] = value
            if value != 0:
                # Those that ended first may be why it failed (a peer gone from a collective).
                done = [r for r in range(self.nprocs) if r != rank and self._ended_ok(r)]
                self.failures.append(RankFailure(rank, value, lines, ended_before=done))
                self._failed.set()
        if self._first_end is None and value == 0:
            self._first_end = now

    def _ended_ok(self, rank: int) -> bool:
        return self.ended.get(rank, self.exited.get(rank)) == 0

    def _finished(self, rank: int) -> bool:
        return rank in self.exited or rank in self.ended

    def _unfinished(self, but: int = -1) -> list[int]:
        return [r for r in range(self.nprocs) if r != but and not self._finished(r)]

    def _note_progress(self, rank: int, lines: list[str], now: float) -> None:
        point = hook.wait_point(lines)
        seen = self._progress.get(rank)
        if seen is None or point is None or seen.point is None or seen.point.where != point.where:
            self._progress[rank] = _Progress(point, now, lines)
        else:
            seen.point, seen.stack = point, lines

    def _judge_left(self, now: float, launcher_done: bool) -> None:
        """A rank that left mid-program: fine if the others end with it, else the cause."""
        for rank, (at, tail) in list(self._left.items()):
            waiting = self._unfinished(but=rank)
            if not waiting:
                del self._left[rank]
            elif launcher_done or self._failed.is_set() or now - at > LEFT_WINDOW_S:
                del self._left[rank]
                reason = (
                    f"rank {rank} exited with code 0 in the middle of its program "
                    "(os._exit(0) or an exit from C: Python never reached the program's end) "
                    f"while {ranks_phrase(waiting)} had not ended"
                )
                # The cause goes first: the others fail because of it.
                self.failures.insert(0, RankFailure(rank, 0, tail, reason))
                self._failed.set()

    def _watch_the_rest(self, proc: subprocess.Popen[bytes], now: float) -> None:
        """After a rank has ended: are the ranks still running stuck waiting for it?"""
        if self._first_end is None or not self.nprocs or self._failed.is_set():
            return
        running = self._unfinished()
        if not running:
            return
        interval = max(0.5, min(5.0, self.end_grace / 4))
        # The first look a moment after the end: ranks finishing together need
        # none. Across nodes the signal reaches every supervisor through the
        # launcher, which cannot skip one still starting (the signal would
        # kill it): there the first look waits a whole grace.
        first = self._first_end + (interval if self.local else self.end_grace)
        if now >= first and now - self._sampled_at >= interval:
            self._sampled_at = now
            self._request_stacks(proc)
        if now - self._first_end < self.end_grace:
            return
        for rank in running:
            seen = self._progress.get(rank)
            if (
                seen is None
                or seen.point is None
                or not seen.point.communicating
                or now - seen.since < self.end_grace
            ):
                return  # working, or not known to wait for a peer
        gone = [r for r in range(self.nprocs) if self._finished(r)]
        codes = {self.ended.get(r, self.exited.get(r, 0)) for r in gone}
        how = "ended its program" if len(gone) == 1 else "ended their programs"
        reason = (
            f"{ranks_phrase(gone)} {how} (exit code {', '.join(map(str, sorted(codes)))}) while "
            f"{ranks_phrase(running)} still waited in a collective, with no progress for "
            f"{self.end_grace:g} s (MPX_END_GRACE): uneven step counts? Every rank must make "
            "the same collective calls (e.g. the same number of steps)"
        )
        details: list[str] = []
        for rank in running:
            details.append(f"mpxrun: rank {rank}'s Python stack:")
            details.extend(f"    {line}" for line in self._progress[rank].stack)
        self.failures.insert(0, RankFailure(gone[0], 0, [], reason, details))
        self._failed.set()

    def _judge_missing(self) -> None:
        """After the launcher: a rank that never reported an exit did not finish."""
        if not self.nprocs or self.failures or self.timed_out:
            return
        missing = [
            r for r in range(self.nprocs) if r not in self.exited and self.ended.get(r, 1) != 0
        ]
        if missing:
            reason = (
                f"{ranks_phrase(missing)} ended without an exit status before the program's end "
                "(killed by the launcher or a signal)"
            )
            self.failures.append(RankFailure(missing[0], 0, [], reason))

    def _supervisors(self, proc: subprocess.Popen[bytes]) -> list[int]:
        """The pids of the rank supervisors the launcher started on this host.

        Found by descent from the launcher, not by session: Hydra puts each
        proxy and each rank in a session of its own.
        """
        children: dict[int, list[int]] = {}
        commands: dict[int, list[bytes]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as fh:
                    ppid = int(fh.read().rsplit(b")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    commands[int(entry)] = fh.read().split(b"\0")
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue
            children.setdefault(ppid, []).append(int(entry))
        found, todo = [], [proc.pid]
        while todo:
            pid = todo.pop()
            if commands.get(pid, [])[1:3] == [b"-m", b"mpx.launch.rank"]:
                found.append(pid)  # its program is its business
            else:
                todo.extend(children.get(pid, []))
        return found

    def _request_stacks(self, proc: subprocess.Popen[bytes]) -> None:
        if self.local:
            for pid in self._supervisors(proc):
                # One starting up, or exiting, would die of the signal's default action.
                if hook.handles_dump_signal(pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, hook.DUMP_SIGNAL)
        else:
            # Hydra, mpirun and srun pass SIGUSR1 on to the processes they started.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(proc.pid, hook.DUMP_SIGNAL)

    def _collect_stacks(self, proc: subprocess.Popen[bytes]) -> None:
        """Asks the ranks still running for their Python stacks and prints them."""
        with self._lock:
            self.stacks.clear()  # only answers to this request count
        self._request_stacks(proc)
        deadline = time.monotonic() + STACKS_WAIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            if self.nprocs and set(self._unfinished()) <= set(self.stacks):
                break
            time.sleep(0.02)
        # Without a rank count, the ranks that answered are the ones running.
        running = self._unfinished() if self.nprocs else sorted(self.stacks)
        done = sorted(r for r in self.ended if r not in self.exited)
        lines = []
        if running:
            lines.append(f"mpxrun: --timeout reached; still running: {ranks_phrase(running)}")
        for rank in done:
            lines.append(
                f"mpxrun: rank {rank} had already finished its program (exit code "
                f"{self.ended[rank]}) and was waiting to exit (in MPI_Finalize, for the others)"
            )
        for rank in running:
            if rank in self.stacks:
                lines.append(f"mpxrun: rank {rank}'s Python stack:")
                lines.extend(f"    {line}" for line in self.stacks[rank])
            else:
                lines.append(f"mpxrun: rank {rank} sent no stack within {STACKS_WAIT_S:g} s")
        if lines:
            self.stderr.write(("\n".join(lines) + "\n").encode())
            self.stderr.flush()

    def _all_ranks_done(self) -> bool:
        return (
            self.end_when_ranks_exit
            and self.nprocs > 0
            and len(self.exited) == self.nprocs
            and not any(self.exited.values())
        )

    def _signal_all(self, proc: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    def _stop(self, proc: subprocess.Popen[bytes]) -> None:
        self._signal_all(proc, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE_S
        while proc.poll() is None and time.monotonic() < deadline:
            if self.launcher_lingers and self.local and not self._supervisors(proc):
                break  # every rank has ended: only the launcher's linger is left
            time.sleep(0.02)
        self._signal_all(proc, signal.SIGKILL)

    def run(self, timeout: float | None = None) -> int:
        """Runs the job to its end; returns the launcher's exit code."""
        env = self.env
        passed: tuple[int, ...] = ()
        sources: list[IO[bytes]] = []
        if self.own_output:
            # The ranks inherit these through the launcher; it never reads them.
            read_end, write_end = os.pipe()
            stdout = os.dup(1)
            passed = (stdout, write_end)
            env = dict(env, **{settings.OUTPUT_FDS.name: f"{stdout},{write_end}"})
            sources.append(os.fdopen(read_end, "rb"))
        try:
            proc = subprocess.Popen(
                self.command,
                env=env,
                stderr=subprocess.PIPE,
                pass_fds=passed,
                start_new_session=True,
                # If mpxrun itself is SIGKILLed, the launcher still gets a SIGTERM.
                preexec_fn=lambda: die_with_parent(signal.SIGTERM),  # noqa: PLW1509 (no threads run yet)
            )
        finally:
            for fd in passed:  # only the ranks hold them now: EOF when the last one ends
                os.close(fd)
        assert proc.stderr is not None
        sources.append(proc.stderr)
        pumps = [
            threading.Thread(target=self._pump, args=(source,), daemon=True) for source in sources
        ]
        for pump in pumps:
            pump.start()
        start = time.monotonic()
        failed_at: float | None = None
        all_exited_at: float | None = None
        try:
            while proc.poll() is None:
                now = time.monotonic()
                with self._lock:
                    self._judge_left(now, launcher_done=False)
                    self._watch_the_rest(proc, now)
                if timeout is not None and now - start > timeout:
                    self.timed_out = True
                    self._collect_stacks(proc)
                    self._stop(proc)
                    break
                if self.cancel.is_set():
                    self._stop(proc)
                    break
                if self._failed.is_set():
                    failed_at = now if failed_at is None else failed_at
                    grace = 0.0 if self.launcher_lingers else LAUNCHER_GRACE_S
                    if now - failed_at > grace:
                        self._stop(proc)
                        break
                elif self._all_ranks_done():
                    all_exited_at = now if all_exited_at is None else all_exited_at
                    if now - all_exited_at >= LINGER_S:
                        # SIGKILL: a SIGTERMed gforker reports each rank as "signaled".
                        self._signal_all(proc, signal.SIGKILL)
                        proc.wait()
                        for pump in pumps:
                            pump.join(timeout=5.0)
                        return 0
                self._news.wait(POLL_S)
                self._news.clear()  # what it announced is in the records, read above
        except KeyboardInterrupt:
            self._stop(proc)
            proc.wait()
            raise
        code = proc.wait()
        # Whatever the launcher left in its session (a proxy, a stray rank) goes too.
        self._signal_all(proc, signal.SIGKILL)
        for pump in pumps:
            pump.join(timeout=5.0)
        with self._lock:
            self._judge_left(time.monotonic(), launcher_done=True)
            self._judge_missing()
        return code
