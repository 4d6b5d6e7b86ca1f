"""benchmarks/gpu_report.py, the one command of a lent GPU, tried on CPU.

Here (CI: no GPU) the report must refuse to run, saying what is missing, and
its plumbing (parts, budgets, tables, the detached run the device tool needs)
must work with ``--cpu-smoke``. The complete ``--cpu-smoke`` run (every part,
2 ranks, tiny sizes) takes minutes on CI's 2 cores and stays out of CI: run it
by hand, ``python benchmarks/gpu_report.py --cpu-smoke`` (DEVELOPERS.md).
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_report.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_report", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_report"] = module  # dataclasses looks the module up by name
    spec.loader.exec_module(module)
    return module


def _has_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT,
    )  # fmt: skip


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU: the report would run")
def test_without_a_gpu_it_exits_2_saying_what_is_missing(tmp_path: Path) -> None:
    done = _run("--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu_report: cannot run: no CUDA GPU" in done.stderr
    assert "--cpu-smoke" in done.stderr  # and what to do instead
    assert not (tmp_path / "out").exists()  # nothing was run, nothing written


def test_cpu_smoke_marks_the_gpu_parts_skipped(tmp_path: Path) -> None:
    done = _run("--cpu-smoke", "--only", "gpu-tests,gpu-mpi-tests", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "gpu-report.md").read_text()
    assert "Device: none (--cpu-smoke)" in text
    assert "## gpu-tests:" in text
    assert "## gpu-mpi-tests:" in text
    assert text.count("skipped: no GPU") == 2


def test_unknown_part_is_an_error_naming_the_parts(tmp_path: Path) -> None:
    done = _run("--cpu-smoke", "--only", "gpu-tets", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "no part named ['gpu-tets']" in done.stderr
    assert "gpu-tests" in done.stderr


def test_a_part_past_its_budget_keeps_its_output_and_says_so(tmp_path: Path) -> None:
    report = _module()
    code = "import sys, time; print('| row | 1 |', flush=True); time.sleep(60)"
    part = report.Part(
        "slow", "cpu", "a part that hangs", 3, lambda smoke: [[sys.executable, "-c", code]]
    )
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(part, False, md, log) is False
    text = md.read_text()
    assert "| row | 1 |" in text  # what it printed before its budget ran out
    assert "timed out after its budget of 3 s" in text


def test_a_part_past_its_budget_is_ended_with_its_children(tmp_path: Path) -> None:
    """An mpxrun job's ranks are the part's grandchildren: none may outlive the budget."""
    report = _module()
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(f'| child | {p.pid} |', flush=True); time.sleep(120)"
    )
    part = report.Part("job", "cpu", "a job", 3, lambda smoke: [[sys.executable, "-c", code]])
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(part, False, md, log) is False
    match = re.search(r"\| child \| (\d+) \|", md.read_text())
    assert match is not None
    pid = int(match.group(1))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _running(pid):
        time.sleep(0.1)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_a_failing_part_is_reported_and_the_next_one_still_runs(tmp_path: Path) -> None:
    report = _module()
    fails = report.Part(
        "bad", "cpu", "fails", 30, lambda smoke: [[sys.executable, "-c", "exit(4)"]]
    )
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(fails, False, md, log) is False
    assert "**failed: exit 4**" in md.read_text()


def test_pytest_outcomes_table() -> None:
    report = _module()
    output = "\n".join(
        [
            "....s",
            "==== short test summary info ====",
            "PASSED packages/quantize/tests/test_cuda.py::test_same_bytes",
            "PASSED packages/quantize/tests/test_cuda.py::test_same_bytes",  # rank 1's summary
            "FAILED packages/quantize/tests/test_cuda.py::test_unbiased - AssertionError: x",
            "SKIPPED [2] packages/collectives/tests/test_ipc.py:12: needs two GPUs",
            "==== 1 failed, 1 passed, 2 skipped in 3.2s ====",
        ]
    )
    table = report.pytest_outcomes(output)
    assert table.count("| PASSED | `packages/quantize/tests/test_cuda.py::test_same_bytes` |") == 1
    assert (
        "| FAILED | `packages/quantize/tests/test_cuda.py::test_unbiased - AssertionError: x` |"
        in table
    )
    assert "| SKIPPED | `[2] packages/collectives/tests/test_ipc.py:12: needs two GPUs` |" in table
    assert table.rstrip().endswith("1 failed, 1 passed, 2 skipped in 3.2s")
    assert "No test outcome" in report.pytest_outcomes("")


def test_follow_runs_detached_and_a_second_call_follows_the_same_run(tmp_path: Path) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    args = ["--cpu-smoke", "--only", "gpu-tests", "--state", str(state), "--out", str(out)]
    first = _run(*args, "--follow", "200")
    assert first.returncode == 0, first.stdout + first.stderr
    assert "started detached" in first.stdout
    assert "skipped: no GPU" in (out / "gpu-report.md").read_text()
    pid = (state / "pid").read_text()
    (out / "gpu-report.md").unlink()
    second = _run(*args, "--follow", "200")
    assert second.returncode == 0, second.stdout + second.stderr
    assert "following the run" in second.stdout
    assert (state / "pid").read_text() == pid  # no new run
    assert (out / "gpu-report.md").exists()  # copied again


def test_follow_says_still_running_when_time_is_up(tmp_path: Path) -> None:
    report = _module()
    state, out = tmp_path / "state", tmp_path / "out"
    state.mkdir()
    slow = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (state / "pid").write_text(str(slow.pid))
        (state / "gpu-report.md").write_text("# partial\n")
        code = report.follow([], state, out, time.monotonic() + 1)
    finally:
        slow.kill()
        slow.wait()
    assert code == report.EXIT_STILL_RUNNING
    assert (out / "gpu-report.md").read_text() == "# partial\n"


def test_every_benchmark_option_the_report_passes_exists() -> None:
    """The report's benchmark commands use only options their benchmarks declare."""
    report = _module()
    wanted: dict[str, set[str]] = {}
    for part in report.PARTS:
        for smoke in (False, True):
            for command in part.command(smoke):
                scripts = [w for w in command if "/benchmarks/bench_" in w]
                if scripts:
                    after = command[command.index(scripts[0]) + 1 :]
                    wanted.setdefault(scripts[0], set()).update(w for w in after if w[:2] == "--")
    assert len(wanted) == 5
    for script, options in wanted.items():
        done = subprocess.run(
            [sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        missing = sorted(o for o in options if o not in done.stdout)
        assert not missing, f"{script} has no {missing}"
