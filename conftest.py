"""mpx's multi-rank testing, for every package's tests.

One way, used everywhere: tests marked ``@pytest.mark.mpi`` are written in
mpi4py's manner (they never assume a world size) and nox runs them as::

    mpxrun -n 1|2|3 --timeout T -- python -m pytest -m mpi packages/

every rank running the same tests in the same order. Two things keep one
rank's failure from hanging the others:

* After every mpi test, the ranks agree on its outcome with
  :meth:`mpx.collectives.Communicator.agree` on a private communicator whose
  timeout is ``MPX_TEST_AGREE_TIMEOUT`` (120 s)::

      rank 0:  test A ──┐            ┌── test B ...
      rank 1:  test A ──┼─ agree(A) ─┼── test B ...     failed anywhere -> the
      rank 2:  test A ──┘            └── test B ...     teardown fails on all ranks,
                                                        naming the ranks and their errors

  A rank whose peers do not arrive in time (they are stuck in a collective
  that this rank left by raising) exits; ``mpxrun`` then stops the job and
  names the rank.
* pytest-timeout's thread method ends a test that hangs by itself.

GPU tests (``@pytest.mark.gpu``) are skipped without CUDA, unless
``MPX_REQUIRE_GPU=1`` (set by ``nox -s tests-gpu``) turns that into a failure.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

AGREE_TIMEOUT_S = float(os.environ.get("MPX_TEST_AGREE_TIMEOUT", "120"))
_FAILED_KEY = pytest.StashKey[str]()  # this rank's failure of the test, in one line


@functools.cache
def _world() -> Any:
    """A private mpx communicator over COMM_WORLD, or None outside a multi-rank run.

    Made in ``pytest_configure``, which every rank runs: making it is collective.
    """
    if not any(k in os.environ for k in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPX_JOB_ID")):
        return None
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() == 1:
        return None
    from mpx.collectives import Communicator

    return Communicator.from_mpi(MPI.COMM_WORLD, timeout=AGREE_TIMEOUT_S)


def pytest_configure(config: pytest.Config) -> None:
    comm = _world()
    if comm is not None and comm.rank != 0:
        # The other ranks report failures only. The warnings summary and the list of
        # skipped tests are rank 0's: the ranks run the same tests, skip and warn alike,
        # and N copies of one summary buried the results; pytest_terminal_summary counts
        # their warnings.
        config.option.verbose = -2
        config.option.disable_warnings = True
        config.option.reportchars = "fE"  # for a terminal reporter made after this hook
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:  # one made before this hook read the options already
            reporter.reportchars = "".join(c for c in reporter.reportchars if c in "fE")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """On ranks other than 0: how many warnings the summary of rank 0 does not list."""
    comm = _world()
    count = len(terminalreporter.stats.get("warnings", []))
    if comm is not None and comm.rank != 0 and count:
        terminalreporter.write_line(
            f"rank {comm.rank}: {count} warning(s), not listed: the warnings summary is rank 0's"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return
    try:
        import torch

        has_cuda = bool(torch.cuda.is_available())
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    if os.environ.get("MPX_REQUIRE_GPU") == "1":
        raise pytest.UsageError("MPX_REQUIRE_GPU=1 but torch sees no CUDA device")
    skip = pytest.mark.skip(reason="needs a CUDA GPU (nox -s tests-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _agree(comm: Any, failure: str | None, nodeid: str) -> str | None:
    """None if the test passed on every rank, else what failed where; exits if peers never come."""
    from mpx.collectives import CollectiveTimeout, RemoteError

    try:
        comm.agree(failure, nodeid)
    except RemoteError as err:
        return str(err)
    except CollectiveTimeout as err:
        sys.stderr.write(
            f"\nrank {comm.rank}: peers did not finish {nodeid} within "
            f"{AGREE_TIMEOUT_S:g} s (a rank failed or hangs inside a collective: {err}); "
            "ending this rank so that mpxrun stops the job\n"
        )
        sys.stderr.flush()
        os._exit(3)
    return None


def _summary(report: pytest.TestReport, call: pytest.CallInfo[None]) -> str:
    """One line for the other ranks: the exception, or the report's last line."""
    if call.excinfo is not None:
        text = call.excinfo.exconly()
    else:
        text = (report.longreprtext.strip().splitlines() or ["failed"])[-1]
    first = text.strip().splitlines()[0] if text.strip() else "failed"
    return f"{first[:300]} ({call.when})"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if "mpi" not in item.keywords:
        return
    comm = _world()
    if comm is None:
        return
    if report.failed:
        if _FAILED_KEY not in item.stash:
            item.stash[_FAILED_KEY] = _summary(report, call)
        # Say it now: if the peers are stuck, this rank may never reach its summary.
        sys.stderr.write(f"\nrank {comm.rank}: {item.nodeid} failed ({call.when}):\n")
        sys.stderr.write(f"{report.longreprtext}\n")
        sys.stderr.flush()
    if call.when != "teardown":
        return
    # Teardown runs for every test on every rank, whatever failed before it,
    # so it is the one place where all ranks are sure to meet.
    mine = item.stash.get(_FAILED_KEY, None)
    failed = _agree(comm, mine, item.nodeid)
    if failed is not None and mine is None:
        report.outcome = "failed"
        report.longrepr = f"{failed} (see that rank's output)"


# torch's rendezvous variables: a launcher, or a test of init_torch_env, may leave them set.
_RENDEZVOUS = (
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
    "MASTER_PORT",
)  # fmt: skip


@pytest.fixture
def user_environment() -> dict[str, str]:
    """This process's environment as a user's shell has it, for the jobs a test starts."""
    return {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}


@pytest.fixture(autouse=True)
def _settings_read_afresh() -> Iterator[None]:
    """A test that changes MPX_* variables (monkeypatch, then reload) leaves none cached.

    Torn down after monkeypatch has restored the environment, so the next
    test reads the variables as they are again.
    """
    yield
    try:
        from mpx.launch.settings import reload
    except ImportError:  # mpx-launch not installed: nothing is cached
        return
    reload()


# What mpxrun exports to its ranks, and keeps when it finds them set (as the user's).
_TORCHRUN_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
_TORCHRUN_VARIABLES |= {"MASTER_ADDR", "MASTER_PORT", "MPX_TORCH_ENV"}


def _fresh_job_environment(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("PMI_") and k not in _TORCHRUN_VARIABLES
    }
    return env | extra


@pytest.fixture
def fresh_job_environment() -> Callable[..., dict[str, str]]:
    """Makes the environment for an mpxrun a test starts as a job of its own.

    This process's environment, plus the keyword arguments, without the
    traces of its own job: neither a rank of a job around this one (nox's mpi
    runs: ``PMI_*``), nor the torchrun variables an earlier test left in this
    process (``init_torch_env``), which mpxrun would take for the user's.
    """
    return _fresh_job_environment


# torch 2.13's gloo sometimes aborts a finished process at exit, after
# destroy_process_group, with no Python frame left: measured on this 2-core VM
# with examples/ddp_torchrun.py --backend gloo, 6 of 24 runs under torchrun
# itself (python -m torch.distributed.run, no mpx imported) and 2 of 24 under
# mpxrun with TORCH_DEVICE_BACKEND_AUTOLOAD=0. Only gloo control runs (the
# reference mpx is compared with) are retried, only for that abort.
GLOO_EXIT_ABORT = "terminate called without an active exception"
GLOO_CONTROL_ATTEMPTS = 3


def _run_job(
    nprocs: int,
    script_and_args: list[str],
    env: dict[str, str],
    timeout: float,
    gloo_control: bool = False,
) -> subprocess.CompletedProcess[str]:
    mpxrun = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
    command = [mpxrun, "-n", str(nprocs), "--timeout", str(int(timeout * 0.9)), "--"]
    command += [sys.executable, *script_and_args]
    for _ in range(GLOO_CONTROL_ATTEMPTS if gloo_control else 1):
        done = subprocess.run(
            command, capture_output=True, text=True, env=env, timeout=timeout, check=False
        )
        if not (gloo_control and done.returncode == 134 and GLOO_EXIT_ABORT in done.stderr):
            break
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture
def run_job() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Runs ``python SCRIPT ARGS`` under ``mpxrun -n N`` and asserts that it succeeded.

    ``run_job(nprocs, [script, *args], env, timeout, gloo_control=False)``;
    ``gloo_control=True`` retries a gloo reference run that torch's gloo
    aborted at exit (:data:`GLOO_EXIT_ABORT`), up to 3 attempts in all.
    """
    return _run_job
