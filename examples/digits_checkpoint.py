"""The main job's checkpoints and its injected failure (examples/train_digits.py).

* :func:`resume` / :func:`checkpoint`: --checkpoint-dir, through
  mpx.dataparallel's resume and save_resumable; a directory another run's
  flags wrote is refused (examples/demo_runs.py).
* :func:`nothing_to_train`: a checkpoint of a finished run leaves nothing to do.
* :data:`FAIL_AT`, :func:`fail_if_asked`, :func:`failure_skipped`:
  ``MPX_DEMO_FAIL_AT=E:R`` kills rank R at the start of epoch E.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import asdict
from typing import TYPE_CHECKING

from mpx.collectives import Communicator
from mpx.launch.settings import RESTART_COUNT, declare

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import demo_runs, digits_data, digits_layout
else:  # run as scripts: this folder is on sys.path
    import demo_runs
    import digits_data
    import digits_layout

__all__ = [
    "FAIL_AT",
    "checkpoint",
    "fail_if_asked",
    "failure_skipped",
    "nothing_to_train",
    "resume",
]

FAIL_AT = declare(
    "MPX_DEMO_FAIL_AT",
    "str",
    "",
    "examples/train_digits.py: 'E:R' makes rank R kill itself at the start of epoch E of the "
    "first attempt (MPX_RESTART_COUNT 0), to watch mpxrun --max-restarts resume the job",
    package="demo",
)


def resume(args: argparse.Namespace, comm: Communicator, history: digits_data.History) -> int:
    """Loads the newest checkpoint of --checkpoint-dir, if any; the epoch to start at."""
    import mpx.dataparallel as dp

    if not digits_data.RESUMABLE:
        digits_layout.stop(
            f"mpx demo: --checkpoint-dir: --mode {args.mode} does not save checkpoints", comm
        )
    if args.checkpoint_every < 1:
        digits_layout.stop(
            f"mpx demo: --checkpoint-every must be >= 1, got {args.checkpoint_every}", comm
        )
    run = digits_data.RESUMABLE[0]
    # Another mode's (or schedule's) checkpoints would fail to load with missing keys: say whose.
    refusal = demo_runs.check_owner(args.checkpoint_dir, *digits_layout.name_and_flags(args))
    if refusal:
        digits_layout.stop(refusal, comm)  # every rank reads the same file
    point = dp.resume(args.checkpoint_dir, run.model, run.optimizer, comm=comm)
    if point.path is not None:
        for name, values in point.extra["history"].items():
            setattr(history, name, values)
        # A restart (mpxrun --max-restarts) resumes this job's own checkpoints; the
        # first attempt finding some resumes an earlier job's: say it, it may be stale.
        earlier = RESTART_COUNT.get() == 0
        if comm.rank == 0 and earlier and point.epoch < args.epochs:
            print(
                f"mpx demo: {args.checkpoint_dir} holds an earlier run's checkpoints "
                f"(newest: {point.path}, after epoch {point.epoch}); continuing that run. "
                f"To start afresh, remove it: rm -r {args.checkpoint_dir}",
                flush=True,
            )
        if comm.rank == 0 and point.epoch < args.epochs:
            print(f"resumed from {point.path} at epoch {point.epoch + 1}", flush=True)
    return point.epoch


def nothing_to_train(args: argparse.Namespace, first: int, comm: Communicator) -> bool:
    """True, having said why, when the checkpoint resumed is at or past --epochs."""
    if first < args.epochs:
        return False
    if comm.rank == 0:
        print(
            f"mpx demo: nothing to train: {args.checkpoint_dir} is a finished run "
            f"({first} of --epochs {args.epochs} done). Remove it (rm -r "
            f"{args.checkpoint_dir}) to train again, or raise --epochs to continue it; "
            "the summary and plot of that run are left as they are",
            flush=True,
        )
    return True


def failure_skipped(first: int, comm: Communicator) -> None:
    """Says so when MPX_DEMO_FAIL_AT's epoch lies before the epoch the run resumes at."""
    wanted = FAIL_AT.get()
    if not wanted or RESTART_COUNT.get() != 0 or comm.rank != 0:
        return
    at_epoch = wanted.split(":")[0]
    if at_epoch.isdigit() and int(at_epoch) <= first:
        print(
            f"mpx demo: MPX_DEMO_FAIL_AT={wanted}: no failure injected: epoch {at_epoch} "
            f"was done before the checkpoint this run resumes from",
            flush=True,
        )


def checkpoint(
    args: argparse.Namespace, comm: Communicator, done: int, history: digits_data.History
) -> None:
    """Saves the run after ``done`` epochs, every --checkpoint-every and at the end."""
    import mpx.dataparallel as dp

    if done % args.checkpoint_every and done != args.epochs:
        return
    run = digits_data.RESUMABLE[0]
    dp.save_resumable(args.checkpoint_dir, run.model, run.optimizer, epoch=done, batch=0,
                      sharded=run.sharded, comm=comm, history=asdict(history))  # fmt: skip
    if comm.rank == 0:
        demo_runs.record_owner(args.checkpoint_dir, *digits_layout.name_and_flags(args))


def fail_if_asked(epoch: int, comm: Communicator) -> None:
    """MPX_DEMO_FAIL_AT=E:R: rank R dies at the start of epoch E (1-based), first attempt only."""
    wanted = FAIL_AT.get()
    if not wanted or RESTART_COUNT.get() != 0:
        return
    try:
        at_epoch, at_rank = (int(part) for part in wanted.split(":"))
    except ValueError:
        raise SystemExit(f"MPX_DEMO_FAIL_AT={wanted!r}: expected EPOCH:RANK, e.g. 3:1") from None
    if (epoch + 1, comm.rank) == (at_epoch, at_rank):
        os.write(2, f"mpx demo: MPX_DEMO_FAIL_AT={wanted}: rank {comm.rank} kills itself "
                    f"at the start of epoch {epoch + 1}\n".encode())  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)
