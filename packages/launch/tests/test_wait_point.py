"""How ``mpxrun`` reads, from a rank's stack dump, whether it waits for a peer or works."""

from __future__ import annotations

import sysconfig
from pathlib import Path

from mpx.launch.hook import wait_point

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = sysconfig.get_paths()["stdlib"]


def _dump(*frames: tuple[str, int, str], other_thread: bool = True) -> list[str]:
    """A faulthandler dump: a helper thread first, then the main thread's frames."""
    lines = []
    if other_thread:
        lines += [
            "Thread 0x00007f0000000001 (most recent call first):",
            f'  File "{SITE}/mpx/collectives/progress.py", line 80 in _busy',
            '  File f"{STDLIB}/threading.py", line 975 in run',
            "",
        ]
    lines.append("Current thread 0x00007f0000000002 (most recent call first):")
    lines += [f'  File "{path}", line {line} in {func}' for path, line, func in frames]
    return lines


def _program(tmp_path: Path, *lines: str) -> str:
    path = tmp_path / "train.py"
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_an_mpi_call_from_the_program_is_a_wait_for_peers(tmp_path: Path) -> None:
    prog = _program(tmp_path, "def main():", "    comm.Barrier()", "main()")
    point = wait_point(_dump((prog, 2, "main"), (prog, 3, "<module>")))
    assert point is not None
    assert point.communicating
    assert point.where == ((prog, 3, "<module>"), (prog, 2, "main"))


def test_sleeping_or_computing_in_the_program_is_not(tmp_path: Path) -> None:
    prog = _program(tmp_path, "def main():", "    time.sleep(100)", "main()")
    point = wait_point(_dump((prog, 2, "main"), (prog, 3, "<module>")))
    assert point is not None
    assert not point.communicating


def test_a_wait_inside_torch_distributed_or_mpx_is_one(tmp_path: Path) -> None:
    prog = _program(tmp_path, "def step():", "    dist.all_reduce(t)", "step()")
    for library in ("torch/distributed/distributed_c10d.py", "mpx/collectives/handle.py"):
        point = wait_point(
            _dump((f"{SITE}/{library}", 317, "wait"), (prog, 2, "step"), (prog, 3, "<module>"))
        )
        assert point is not None
        assert point.communicating, library


def test_waiting_for_a_subprocess_is_not(tmp_path: Path) -> None:
    prog = _program(tmp_path, "def upload():", "    proc.wait()", "upload()")
    point = wait_point(
        _dump(
            (f"{STDLIB}/subprocess.py", 1264, "wait"),
            (prog, 2, "upload"),
            (prog, 3, "<module>"),
        )
    )
    assert point is not None
    assert not point.communicating
    assert point.where[-1] == (prog, 2, "upload")


def test_a_polling_loop_inside_the_library_stays_at_one_point(tmp_path: Path) -> None:
    # mpx's waits poll in Python: the library's lines change, the program's do not.
    prog = _program(tmp_path, "def step():", "    allreduce(t)", "step()")
    first = wait_point(
        _dump(
            (f"{SITE}/mpx/collectives/handle.py", 170, "pause"),
            (f"{SITE}/mpx/collectives/handle.py", 330, "wait"),
            (prog, 2, "step"),
            (prog, 3, "<module>"),
        )
    )
    second = wait_point(
        _dump(
            (f"{SITE}/mpx/collectives/handle.py", 328, "wait"),
            (prog, 2, "step"),
            (prog, 3, "<module>"),
        )
    )
    assert first is not None
    assert second is not None
    assert first.where == second.where


def test_no_python_stack_is_no_point() -> None:
    assert wait_point(["(no Python stack: the program does not handle SIGUSR1)"]) is None
