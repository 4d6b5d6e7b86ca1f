"""run_torch_files: torch's MultiProcessTestCase files under MPI ranks, mpx against gloo."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).resolve().parent


def _module(name: str) -> ModuleType:
    sys.path.insert(0, str(HERE))
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


files = _module("run_torch_files")


def test_without_torch_sources_it_says_so_and_runs_nothing(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert files.main(["--torch-tests", str(tmp_path)]) == 0
    said = capsys.readouterr().out
    assert "torch's test sources are not here" in said
    assert "distributed/test_c10d_gloo.py" in said
    assert "none run" in said


def test_tests_that_never_touch_mpx_are_counted_apart() -> None:
    control = {"a": {"event": "pass"}, "b": {"event": "pass"}, "c": {"event": "pass"}}
    tested = {
        "a": {"event": "pass"},
        "b": {"event": "skip", "detail": "apart"},
        "c": {"event": "fail", "detail": "E: boom"},
    }
    result = files.compare_file(control, tested, "apart")
    assert result["not_on_tested"] == ["b"]
    assert (result["passes"], result["control_passes"]) == (1, 2)
    assert list(result["differ"]) == ["c"]


def test_the_listing_finds_what_unittest_finds() -> None:
    """torch names a few tests test* without the underscore (LocalRankTest.testWithoutEnv)."""
    driver_files = _module("driver_files")
    names = driver_files.test_names(driver_files.load(HERE / "multiprocess_sample.py"))
    assert names == [
        "FourRanksTest.testNamedWithoutUnderscore",
        "FourRanksTest.test_needs_four",
        "SampleTest.test_all_reduce_through_init_process_group",
        "SampleTest.test_gloo_class_built_directly",
    ]


def test_a_failure_on_gloos_own_api_is_counted_apart_and_no_other() -> None:
    """create_device is ProcessGroupGloo's: failing on it alone is not an mpx regression."""
    gloo_api = "AttributeError: 'MPXProcessGroup' object has no attribute 'create_device'"
    control = {t: {"event": "pass"} for t in ("a", "b", "c", "d")}
    tested = {
        "a": {"event": "pass"},
        "b": {"event": "fail", "detail": f"Traceback (most recent call last):\n  ...\n{gloo_api}"},
        "c": {"event": "fail", "detail": "AttributeError: 'Tensor' object has no attribute 'x'"},
        # The words in a message of another error are not the call itself.
        "d": {"event": "fail", "detail": f"AssertionError: expected {gloo_api!r}"},
    }
    result = files.compare_file(control, tested, "apart")
    assert result["gloo_api"] == ["b"]
    assert sorted(result["differ"]) == ["c", "d"]
    assert (result["passes"], result["control_passes"]) == (1, 4)


@pytest.mark.timeout(600)
def test_a_sample_file_runs_on_mpx_and_gloo(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Our own MultiProcessTestCase sample: one test on mpx, one on gloo's class, one for 4."""
    bin_dir = os.path.dirname(sys.executable)
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"  # mpxrun beside python
    argv = ["--torch-tests", str(HERE), "--files", "multiprocess_sample.py", "--out", str(tmp_path)]
    assert files.main(argv) == 0
    said = capsys.readouterr().out
    assert "mpx passes 1 of the 1 tests gloo passes (1 make no mpx group" in said


def test_the_sample_without_torch_sources_is_a_skip_said_so(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CI has no torch checkout: the sample says SKIPPED (not a pass) and fails nothing."""
    monkeypatch.delenv("MPX_TORCH_TESTS", raising=False)
    assert files.run_sample(2, tmp_path) == 0
    said = capsys.readouterr().out
    assert "torch test files: SKIPPED, not a pass" in said
    assert "MPX_TORCH_TESTS is not set" in said
    assert "mpx passes" not in said


@pytest.mark.timeout(600)
def test_the_sample_runs_its_tests_only(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Of a file, the sample runs the tests it names (here one of our sample file's three)."""
    bin_dir = os.path.dirname(sys.executable)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPX_TORCH_TESTS", str(HERE))
    named = ("SampleTest.test_all_reduce_through_init_process_group",)
    monkeypatch.setattr(files, "SAMPLE", {"multiprocess_sample.py": named})
    assert files.run_sample(2, tmp_path) == 0
    said = capsys.readouterr().out
    assert "mpx passes 1 of the 1 tests gloo passes (0 make no mpx group" in said
