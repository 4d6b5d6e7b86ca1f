"""One rank of a conformance job: runs tests of torch's own distributed suite in turn.

Started by ``run_conformance.py`` as ``mpxrun -n N -- python driver.py ...``;
every rank runs the same tests in the same order. For each test it does what
torch's ``TestDistBackend._run`` does in its spawned processes (initialise
the default group from a shared file, the suite's file barrier, the test,
the barrier, destroy), but ranks come from MPI instead of a fork, so the
``mpx`` backend (which takes its ranks from MPI) runs under the same driver
as ``gloo``.

Selection and expectations are gloo's: the suite's decorators read
``BACKEND`` at import (and ``skip_if_small_worldsize`` reads it again at
run time), so ``BACKEND=gloo`` stays in the environment while the module's
``BACKEND``, which the tests pass to ``init_process_group``/``new_group``,
names the backend under test.

Each rank appends one JSON line per event to ``rank<r>.jsonl`` (one
``os.write`` per line): ``start`` before a test, then its outcome. After a
test the ranks meet on an MPI barrier with a deadline; a rank whose peers do
not arrive (one is stuck in a collective the others left by failing) exits,
and the orchestrator restarts the job after that test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import traceback
import unittest
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

__all__ = [
    "GLOO_BRANCH_TESTS",
    "SKIP_EXIT_CODES",
    "SYNC_DEADLINE_S",
    "outcome",
    "record",
    "run_all",
    "sync",
]

# The exit codes of the suite's own skip decorators (sys.exit inside a rank).
SKIP_EXIT_CODES = frozenset(range(72, 90))
# Tests whose bodies build their model only under ``if BACKEND in ("mpi",
# "gloo")`` (else they fail on an unbound variable whatever the backend): they
# run with the module's BACKEND reading "gloo", on the default group, which is
# still the backend under test (they make no group of their own).
GLOO_BRANCH_TESTS = frozenset(
    {
        "test_accumulate_gradients_no_sync",
        "test_accumulate_gradients_no_sync_allreduce_hook",
        "test_accumulate_gradients_no_sync_allreduce_with_then_hook",
        "test_accumulate_gradients_no_sync_grad_is_view",
    }
)
SYNC_DEADLINE_S = 30.0


def record(fd: int, **event: Any) -> None:
    """Appends one JSON line (one ``os.write``, so ranks' lines never interleave)."""
    os.write(fd, (json.dumps(event) + "\n").encode())


def sync(comm: Any, deadline_s: float) -> bool:
    """An MPI barrier that gives up after ``deadline_s``: False if a peer never came."""
    request = comm.Ibarrier()
    end = time.monotonic() + deadline_s
    while not request.Test():
        if time.monotonic() > end:
            return False
        time.sleep(0.005)
    return True


def outcome(test: Callable[[], object]) -> tuple[str, str]:
    """Runs ``test``: ("pass"|"skip"|"fail", detail); the default group is destroyed after."""
    import torch.distributed as dist

    try:
        test()
    except unittest.SkipTest as skip:
        return "skip", str(skip)
    except SystemExit as stop:
        if stop.code in SKIP_EXIT_CODES:
            return "skip", f"exit {stop.code}"
        return "fail", f"SystemExit({stop.code})"
    except BaseException as error:
        lines = traceback.format_exception(error)
        return "fail", "".join(lines[-12:])[-3000:]
    finally:
        if dist.is_initialized():
            # The outcome is recorded; the next test initialises afresh.
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    return "pass", ""


def run_all(
    names: Sequence[str], out: Path, comm: Any, run: Callable[[str], tuple[str, str]]
) -> None:
    """Runs each test with ``run`` from the starting environment, recording to ``rank<r>.jsonl``.

    A ``start`` line, then the outcome; then the ranks meet (``sync``): a rank
    whose peers never come exits (code 3) and the orchestrator restarts the job
    after that test.
    """
    # Each test starts from this environment: in torch's own runs every test
    # is a fresh process, and some leave variables behind (with_dist_debug_levels
    # leaves TORCH_DISTRIBUTED_DEBUG=DETAIL when it was unset).
    pristine = dict(os.environ)
    fd = os.open(out / f"rank{comm.Get_rank()}.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    for name in names:
        os.environ.clear()
        os.environ.update(pristine)
        record(fd, test=name, event="start")
        started = time.monotonic()
        status, detail = run(name)
        seconds = round(time.monotonic() - started)
        record(fd, test=name, event=status, detail=detail, seconds=seconds)
        if not sync(comm, SYNC_DEADLINE_S):
            record(fd, test=name, event="stuck-peer")
            os._exit(3)


def _run_one(
    suite: Any, case_class: type, name: str, rank: int, size: int, root: Path
) -> tuple[str, str]:
    """Runs test ``name`` on this rank: ("pass"|"skip"|"fail", detail)."""
    import torch.distributed as dist

    temp = root / name
    for sub in ("barrier", "test_dir", "init_dir"):
        (temp / sub).mkdir(parents=True, exist_ok=True)
    init_method = f"file://{temp / 'init_dir' / 'shared_init_file'}"
    backend = suite.BACKEND
    os.environ["TEMP_DIR"] = str(temp)
    os.environ["INIT_METHOD"] = init_method
    suite.INIT_METHOD = init_method
    suite.Barrier.barrier_id = 0
    case = case_class(name)
    case.rank = rank
    case.file_name = str(temp / "default_group_file")
    seconds = suite.CUSTOM_PG_TIMEOUT.get(name, suite.default_pg_timeout)

    def test() -> None:
        dist.init_process_group(
            init_method=f"file://{case.file_name}",
            backend=backend,
            world_size=size,
            rank=rank,
            timeout=timedelta(seconds=seconds),
        )
        case._barrier()
        if name in GLOO_BRANCH_TESTS:
            suite.BACKEND = "gloo"
        try:
            getattr(case, name)()
        finally:
            suite.BACKEND = backend
        case._barrier()
        dist.destroy_process_group()

    return outcome(test)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True, help="the backend under test: mpx or gloo")
    parser.add_argument("--tests", required=True, type=Path, help="file: one test name a line")
    parser.add_argument("--out", required=True, type=Path, help="folder of the result files")
    parser.add_argument(
        "--lift-size-gate",
        action="store_true",
        help="run the tests that skip_if_small_worldsize keeps for 8+ ranks (or MPI)",
    )
    args = parser.parse_args()
    # Absolute: torch's suite makes file:// URLs of it, and a relative path there
    # reads as a host name (file://conformance-results/...): every rank waits forever.
    args.out = args.out.resolve()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    os.environ["BACKEND"] = "gloo"  # gloo's selection: see the module docstring
    os.environ["WORLD_SIZE"] = str(size)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["TEMP_DIR"] = str(args.out)
    os.environ["PYTORCH_PRINT_REPRO_ON_FAILURE"] = "0"  # keeps the recorded traceback short
    import torch.distributed
    import torch.testing._internal.distributed.distributed_test as suite

    if args.backend in ("mpx", "cgx"):
        import mpx.collectives  # registers the backend

        mpx.collectives.register_torch_backend()
    suite.BACKEND = args.backend
    if args.lift_size_gate:
        # skip_if_small_worldsize runs a test below 8 ranks only when the
        # environment's BACKEND is "mpi" (the suite's tests on groups of some
        # ranks: [1, 2] needs 3). It reads the variable at call time; the
        # selection decorators read it at import, so they stay gloo's.
        os.environ["BACKEND"] = "mpi"

    class Case(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        pass

    names = [n for n in args.tests.read_text().split() if n]
    root = args.out / "tmp"

    def run(name: str) -> tuple[str, str]:
        torch.distributed.set_debug_level_from_env()  # type: ignore[attr-defined]
        return _run_one(suite, Case, name, rank, size, root)

    run_all(names, args.out, comm, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
