"""The progress thread at interpreter exit: it finishes what it is running first."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.collectives.base.progress import enabled

# A completion still running on the progress thread when the program ends. A
# daemon thread is cut off by finalization (and one inside torch's C++ future
# callbacks aborted the process: 'terminate called without an active
# exception'); stopped at exit, the thread finishes the completion first.
PROGRAM = textwrap.dedent(
    """
    import sys, time
    from mpx.collectives.base import progress

    class Slow:
        def ready(self) -> bool:
            return True

        def complete(self) -> None:
            time.sleep(1.0)
            with open(sys.argv[1], "w") as f:
                f.write("finished")

    assert progress.when_ready(Slow())
    time.sleep(0.3)  # the progress thread is inside complete() now
    """
)


@pytest.mark.skipif(not enabled(), reason="MPI_THREAD_MULTIPLE not available: no progress thread")
@pytest.mark.timeout(60)
def test_a_completion_running_at_exit_finishes_before_the_process_ends(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(marker)],
        capture_output=True,
        text=True,
        timeout=50,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "finished", "the progress thread was cut off at exit"
