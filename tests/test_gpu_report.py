"""benchmarks/gpu_report.py, the two calls of a 15-minute GPU window, tried on CPU.

Here (CI: no GPU) the report must refuse to run, saying what is missing; its
plan must fit the window (call 1 ≤ 7 minutes with the install, call 2 ≤ 3),
the parts that matter most first; a part that would not finish in the time
left of its call is skipped with a line saying so; and the jobs of its own
(the allreduce and MGRIT jobs) must run under ``--cpu-smoke``. The whole
``--cpu-smoke`` run (both calls, 2 ranks, tiny sizes: minutes on 2 loaded
cores) stays out of CI: ``python benchmarks/gpu_report.py --cpu-smoke``.
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


def test_the_plan_fits_the_15_minute_window() -> None:
    """Call 1 (install included) ≤ 7 min, call 2 ≤ 3 min, each part within its call."""
    report = _module()
    assert report.CALLS[1].limit_s <= 7 * 60
    assert report.CALLS[2].limit_s <= 3 * 60
    assert report.INSTALL_BUDGET_S <= 90
    for number, call in report.CALLS.items():
        parts = [p for p in report.PARTS if p.call == number]
        assert parts, f"call {number} has no part"
        install = report.INSTALL_BUDGET_S if number == 1 else 0
        assert install + sum(p.budget_s for p in parts) <= call.limit_s
    # The two calls, a machine start (~2 min) and the idle gaps fit 15 minutes.
    assert sum(c.limit_s for c in report.CALLS.values()) + 120 + 60 <= 15 * 60
    lines = report.plan_lines()
    assert lines[0].startswith("call 1 (")
    assert "395 s of 420 s" in lines[0]
    assert any(line.startswith("call 2 (") for line in lines)


def test_parts_are_ordered_by_importance() -> None:
    """What the issue's targets need first: the GPU tests, then the kernels, then allreduce."""
    report = _module()
    names = [(p.call, p.name) for p in report.PARTS]
    assert names == [
        (1, "gpu-tests"),
        (1, "gpu-mpi-tests"),
        (1, "quantize-kernels"),
        (1, "allreduce-cuda"),
        (1, "pipeline-cpu"),
        (2, "mgrit-cpu"),
        (2, "allreduce-cpu"),
    ]


def test_plan_option_prints_the_budgets_and_runs_nothing(tmp_path: Path) -> None:
    done = _run("--plan", "--out", str(tmp_path / "out"), timeout=60)
    assert done.returncode == 0, done.stderr
    assert "call 1 (" in done.stdout
    assert "call 2 (" in done.stdout
    assert re.search(r"^  install\s+90 s$", done.stdout, re.MULTILINE)
    assert not (tmp_path / "out").exists()


def test_a_part_over_the_time_left_is_skipped_with_a_line_saying_so(tmp_path: Path) -> None:
    report = _module()
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w').close()"
    part = report.Part("big", 2, "a part", 60, lambda smoke: [[sys.executable, "-c", code]])
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(part, False, md, log, left_s=30) == "skipped"
    assert "**skipped: its budget of 60 s exceeds the 30 s left of call 2**" in md.read_text()
    assert "--only big" in md.read_text()  # how to run it later
    assert not marker.exists()
    assert report.run_part(part, False, md, log, left_s=61) == "passed"
    assert marker.exists()


def test_the_call_limit_skips_the_later_parts_and_the_exit_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call of 8 s: the first part (budget 3 s) overruns, the second (6 s) no longer fits."""
    report = _module()
    slow = "import time; print('| slow | 1 |', flush=True); time.sleep(30)"
    parts = [
        report.Part("first", 1, "overruns", 3, lambda smoke: [[sys.executable, "-c", slow]]),
        report.Part("second", 1, "fits", 6, lambda smoke: [[sys.executable, "-c", "pass"]]),
        report.Part("third", 2, "cpu", 2, lambda smoke: [[sys.executable, "-c", "pass"]]),
    ]
    monkeypatch.setattr(report, "PARTS", parts)
    monkeypatch.setattr(report, "_device_line", lambda smoke: "Device: a test.")  # no torch import
    monkeypatch.setattr(report, "CALLS", {1: report.Call(1, 8, "gpu"), 2: report.Call(2, 5, "c")})
    out = tmp_path / "out"
    assert report.main(["--cpu-smoke", "--call", "1", "--out", str(out)]) == 1
    text = (out / "gpu-report.md").read_text()
    assert "| slow | 1 |" in text  # what it printed before its budget ran out
    assert "timed out after its budget of 3 s" in text
    assert "**skipped: its budget of 6 s exceeds the" in text
    assert "## third" not in text  # call 2's part: not this call's
    assert re.search(r"\| first \| 1 \| 3 \| [\d.]+ \| failed \|", text)
    assert re.search(r"\| second \| 1 \| 6 \| [\d.]+ \| skipped \|", text)
    # Call 2 appends to the same file, with a limit of its own.
    assert report.main(["--cpu-smoke", "--call", "2", "--out", str(out)]) == 0
    text = (out / "gpu-report.md").read_text()
    assert "# mpx GPU report, call 1" in text
    assert "# mpx GPU report, call 2" in text
    assert re.search(r"\| third \| 2 \| 2 \| [\d.]+ \| passed \|", text)


def test_unknown_part_is_an_error_naming_the_parts(tmp_path: Path) -> None:
    done = _run("--cpu-smoke", "--only", "gpu-tets", "--out", str(tmp_path), timeout=120)
    assert done.returncode == 2
    assert "no part named ['gpu-tets']" in done.stderr
    assert "gpu-tests" in done.stderr


def test_a_part_of_another_call_is_an_error(tmp_path: Path) -> None:
    done = _run("--cpu-smoke", "--call", "2", "--only", "gpu-tests", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "none of these parts is in call 2" in done.stderr


def test_a_part_past_its_budget_is_ended_with_its_children(tmp_path: Path) -> None:
    """An mpxrun job's ranks are the part's grandchildren: none may outlive the budget."""
    report = _module()
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        "print(f'| child | {p.pid} |', flush=True); time.sleep(120)"
    )
    part = report.Part("job", 2, "a job", 3, lambda smoke: [[sys.executable, "-c", code]])
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(part, False, md, log) == "failed"
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


def test_a_failing_part_is_reported(tmp_path: Path) -> None:
    report = _module()
    fails = report.Part("bad", 2, "fails", 30, lambda smoke: [[sys.executable, "-c", "exit(4)"]])
    md, log = tmp_path / "r.md", tmp_path / "r.log"
    assert report.run_part(fails, False, md, log) == "failed"
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


def test_install_builds_this_gpus_architecture_only_without_isolation_or_network(
    tmp_path: Path,
) -> None:
    report = _module()
    wheel = tmp_path / "mpich-5.0.2-py3-none-manylinux_2_28_x86_64.whl"
    carried, builds, final, env = report.install_commands([wheel], tmp_path / "built", "90")
    assert carried == [[*carried[0][:-1], str(wheel)]]
    assert env["MPX_QUANTIZE_CUDA"] == "ON"
    assert env["CMAKE_ARGS"].endswith("-DCMAKE_CUDA_ARCHITECTURES=90-real")
    assert len(builds) == 2  # quantize (nvcc) beside the other five: concurrently
    assert builds[0][-1].endswith("packages/quantize")
    assert sorted(Path(p).name for p in builds[1][-5:]) == sorted(
        ["launch", "collectives", "mgrit", "pipeline", "dataparallel"]
    )
    for command in [*carried, *builds, final]:
        assert "--no-index" in command
        assert "--no-deps" in command
    for command in builds:
        assert "--no-build-isolation" in command
    _, _, _, env = report.install_commands([], tmp_path, None)
    assert env["MPX_QUANTIZE_CUDA"] == "AUTO"  # no GPU (--cpu-smoke): the CPU kernels
    assert "CMAKE_CUDA_ARCHITECTURES" not in env.get("CMAKE_ARGS", "")


def test_only_the_wheels_the_image_lacks_are_installed(tmp_path: Path) -> None:
    report = _module()

    names = [
        f"pytest-{pytest.__version__}-py3-none-any.whl",  # installed, same version: kept
        "pytest-0.1-py3-none-any.whl",  # installed, newer: kept
        "pytest-999.0-py3-none-any.whl",  # older here: installed
        "mpx_no_such_distribution-1.0-py3-none-any.whl",  # missing: installed
    ]
    chosen = report.carried_to_install([tmp_path / n for n in names])
    assert [p.name for p in chosen] == names[2:]


def test_mgrit_configuration_is_torchbraid_like_and_fits_16_ranks() -> None:
    report = _module()
    cfg = report.MGRIT_FULL
    assert cfg.cfactor == 4
    assert cfg.levels >= 4
    assert cfg.steps % max(cfg.rank_counts) == 0
    # LayerParallel splits the fine grid: at least one fine C-interval per rank.
    assert cfg.steps // cfg.cfactor >= max(cfg.rank_counts)
    assert cfg.rank_counts[0] == 16  # the speed-up that matters most, first


def test_the_cpu_jobs_run_under_cpu_smoke(tmp_path: Path) -> None:
    """Call 2's jobs (allreduce and MGRIT under mpxrun -n 2): rows, and the timing table."""
    done = _run("--cpu-smoke", "--call", "2", "--out", str(tmp_path), timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "gpu-report.md").read_text()
    assert re.search(r"^\| serial \| — \| [\d.]+ \| 1\.00 \|$", text, re.MULTILINE), text
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", text, re.MULTILINE), text
    # The model beside the measured rows (costs from the 1-rank row), and beyond them.
    assert re.search(r"^\| 2 \| [\d.]+ \| [\d.]+ \| [+-]\d+% \| [\d.]+ \|$", text, re.M), text
    assert re.search(r"^\| 256 \| — \| [\d.]+ \| — \| [\d.]+ \|$", text, re.M), text
    for path in ("torch.distributed gloo", "mpx `mpi`", "mpx `shm`", "mpx `auto`"):
        assert re.search(rf"^\| 2 \| 4 KiB \| {re.escape(path)} \| [\d.]+ \|", text, re.M), text
    assert re.search(r"\| mgrit-cpu \| 2 \| \d+ \| [\d.]+ \| passed \|", text)


def test_the_pipeline_part_runs_under_cpu_smoke(tmp_path: Path) -> None:
    """Call 1's CPU part (bench_transformer's target rows, at 2 stages here): the rows and
    the targets' lines come back, the part passes."""
    done = _run(
        "--cpu-smoke", "--call", "1", "--only", "pipeline-cpu", "--out", str(tmp_path), timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = (tmp_path / "gpu-report.md").read_text()
    for row in ("mpx 1f1b", "mpx interleaved_zb", "mpx zbv", "mpx async step_every=8"):
        assert re.search(rf"^\| {re.escape(row)} \| 8 \| \d+ \|", text, re.MULTILINE), text
    assert re.search(r"^\| interleaved_zb ≥ 1\.1× mpx 1f1b \(m=8\) \| [\d.]+× \|$", text, re.M)
    # The ceiling at the measured pass costs, and each synchronous row's bound (ms; step ÷ it).
    assert re.search(
        r"^\| the most its layout gains at the measured pass costs .*\| [\d.]+× \|$", text, re.M
    )
    assert re.search(r"^\| mpx interleaved_zb \| 8 \|.*\| \d+ \([\d.]+×\) \|$", text, re.M), text
    assert re.search(r"^\| mpx async step_every=8 \| 8 \|.*\| \d+ \([\d.]+×\) \|$", text, re.M), (
        text
    )
    assert re.search(
        r"^\| the most async gains at the measured pass costs .*\| [\d.]+× \|$", text, re.M
    )
    assert "torch Schedule" not in text  # --only: the targets' rows, not torch's
    assert re.search(r"\| pipeline-cpu \| 1 \| \d+ \| [\d.]+ \| passed \|", text), text


def test_every_benchmark_option_the_report_passes_exists() -> None:
    """The report's benchmark commands use only options their benchmarks declare."""
    report = _module()
    wanted: dict[str, set[str]] = {}
    for part in report.PARTS:
        for smoke in (False, True):
            for command in part.command(smoke):
                scripts = [w for w in command if "/benchmarks/" in w and w.endswith(".py")]
                if scripts:
                    after = command[command.index(scripts[0]) + 1 :]
                    wanted.setdefault(scripts[0], set()).update(w for w in after if w[:2] == "--")
    assert len(wanted) == 3  # bench_quantize.py, bench_transformer.py, the report's own jobs
    for script, options in wanted.items():
        done = subprocess.run(
            [sys.executable, script, "--help"], capture_output=True, text=True, timeout=120,
            check=True,
        )  # fmt: skip
        shown = done.stdout + Path(script).read_text()  # the report's inner options are hidden
        missing = sorted(o for o in options if o not in shown)
        assert not missing, f"{script} has no {missing}"
