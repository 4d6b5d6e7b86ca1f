"""Running out of MPI communicators: an mpx error that names the fix, not MPICH's stack.

MPICH gives a process about 2048 context ids and a communicator takes several, so
~400 splits never freed exhaust them. The test splits in a process of its own (one
that ran out has no communicators left for anything after), started outside any job.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

SCRIPT = """
from mpx.collectives import MPXError, world
kept = []
try:
    for _ in range(10_000):
        kept.append(world().split(0))
except MPXError as err:
    print("RAISED", len(kept), err)
else:
    print("NEVER", len(kept))
"""


def test_running_out_of_communicators_names_the_fix(
    fresh_job_environment: Callable[..., dict[str, str]],
) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        capture_output=True, text=True, timeout=240, check=False, env=fresh_job_environment(),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "RAISED" in done.stdout, done.stdout
    for words in ("no communicators left", "Communicator.free()", "close()", "LayerParallel"):
        assert words in done.stdout, (words, done.stdout)
