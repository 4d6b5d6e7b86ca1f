"""torch's distributed test files beyond distributed_test.py against ``mpx``, gloo the control.

The files are not in the torch wheel: they are read at run time from a
checkout of torch's sources (the tag of the installed torch), never copied
here::

    git clone --depth 1 --branch v2.13.0 https://github.com/pytorch/pytorch /tmp/pytorch
    python tests/conformance/run_torch_files.py --torch-tests /tmp/pytorch/test --ranks 1 2 4

(``MPX_TORCH_TESTS`` may name the folder instead.) Without it the run says
which files it looked for and where, and exits 0 having run nothing.

``--sample`` runs a fixed few of the tests (:data:`SAMPLE`, ~1.5 min at 2
ranks); ``run_conformance.py`` runs it after ``distributed_test.py``, so CI
runs it where ``MPX_TORCH_TESTS`` names torch's sources. Where it names none
(CI has no copy) the sample prints ``torch test files: SKIPPED`` with the
reason: a skip, never counted as a pass. The whole set runs in
``nox -s torch-conformance``, as the command above does.

For each file, every ``MultiProcessTestCase`` test runs on gloo, then on mpx
(``driver_files.py``: ranks from MPI, the groups the test asks gloo for made
on mpx), and a line per file counts how many of the tests gloo passes mpx
passes; tests that make no mpx group are counted apart (they build gloo's
classes themselves, use another backend or none: they never touch mpx), and
so are those whose only failure on mpx is a call of
gloo's own transport API on the group (:data:`GLOO_API`). The exit status is
1 when mpx fails a test gloo passes.

A test runs at the world size its class asks for and is skipped at any
other; torch's classes ask for 1, 2 or 4 ranks (``MultiProcessTestCase``'s
default), so ``--ranks 1 2 4`` runs them all, one job per file and count.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["FILES", "GLOO_API", "SAMPLE", "compare_file", "find_files", "run_sample"]

HERE = Path(__file__).resolve().parent
# Relative to torch's test/ folder; a folder stands for its test_*.py files.
FILES = (
    "distributed/test_c10d_gloo.py",
    "distributed/test_c10d_common.py",
    "distributed/algorithms/ddp_comm_hooks/test_ddp_hooks.py",
    "distributed/test_functional_api.py",
    "distributed/_composable/fsdp",
    "distributed/tensor/parallel",
)

# A failure on mpx that is this (the test calls gloo's transport API on the group's
# backend, e.g. ``pg._get_backend(cpu).create_device(interface="lo")``, which is
# ProcessGroupGloo's and no other backend's) is counted apart, not as a regression:
# with that one call removed, the tests that make it pass on mpx (docs/benchmarks-history.md).
GLOO_API = r"^AttributeError: '\w+' object has no attribute 'create_device'$"

# The fixed sample (--sample): per file, the tests; chosen among those gloo
# passes on CPU at 2 ranks that reach mpx's collectives (uneven all_to_all
# through the functional collectives, DeviceMesh on mpx; DDP's sparse
# gradients through a comm hook that allreduces on the group itself).
SAMPLE = {
    "distributed/test_functional_api.py": (
        "TestCollectivesWithNCCL.test_all_to_all_single",
        "TestCollectivesWithNCCL.test_all_to_all_single_1d_input",
    ),
    "distributed/test_c10d_gloo.py": (
        "DistributedDataParallelTest.test_ddp_comm_hook_sparse_gradients",
        "DistributedDataParallelTest.test_ignored_output_with_unused_parameters",
    ),
}


def _harness() -> ModuleType:
    spec = importlib.util.spec_from_file_location("run_conformance", HERE / "run_conformance.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_files(root: Path | None, wanted: Sequence[str] = FILES) -> tuple[list[Path], list[str]]:
    """The test files under ``root`` (torch's test/ folder), and the entries not found there."""
    found: list[Path] = []
    missing: list[str] = []
    for entry in wanted:
        path = root / entry if root is not None else Path(entry)
        if root is not None and path.is_file():
            found.append(path)
        elif root is not None and path.is_dir() and sorted(path.glob("test_*.py")):
            found += sorted(path.glob("test_*.py"))
        else:
            missing.append(entry)
    return found, missing


def compare_file(
    control: dict[str, dict[str, Any]], tested: dict[str, dict[str, Any]], not_tested: str
) -> dict[str, Any]:
    """``run_conformance.compare``, less the tests that never ran on the tested backend.

    Of the tests the tested backend fails, those that failed only on gloo's own
    API (:data:`GLOO_API`) leave ``differ`` for ``gloo_api``.
    """
    apart = sorted(t for t, o in tested.items() if o.get("detail") == not_tested)
    harness = _harness()
    kept = {t: o for t, o in tested.items() if t not in apart}
    result: dict[str, Any] = harness.compare(
        {t: o for t, o in control.items() if t not in apart}, kept
    )
    result["not_on_tested"] = apart
    differ = result["differ"]
    gloo_api = sorted(
        t
        for t, o in differ.items()
        if o.get("event") == "fail" and re.search(GLOO_API, harness.error_line(o.get("detail", "")))
    )
    result["gloo_api"] = gloo_api
    result["differ"] = {t: o for t, o in differ.items() if t not in gloo_api}
    return result


def _tests_of(path: Path) -> list[str]:
    listing = ["--list", "--backend", "gloo", "--tests", os.devnull, "--out", os.devnull]
    out = subprocess.run(
        [sys.executable, str(HERE / "driver_files.py"), "--file", str(path), *listing],
        check=False,
        capture_output=True,
        text=True,
    )
    if out.returncode != 0:
        raise SystemExit(f"{path}: cannot list its tests:\n{out.stderr[-2000:]}")
    return out.stdout.split()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torch-tests", type=Path, default=os.environ.get("MPX_TORCH_TESTS"))
    parser.add_argument(
        "--ranks", type=int, nargs="+", default=[2], help="one job per count (torch's: 1 2 4)"
    )
    parser.add_argument("-k", dest="pattern", help="only tests whose name matches this regex")
    parser.add_argument("--files", nargs="*", default=list(FILES), help="relative to test/")
    parser.add_argument("--out", type=Path, default=Path("conformance-results/files"))
    parser.add_argument("--sample", action="store_true", help="only the tests of SAMPLE")
    args = parser.parse_args(argv)
    from mpx.collectives.torch.backend import BACKEND_NAME  # noqa: F401  (mpx installed)

    if args.sample:
        found, missing = find_files(args.torch_tests, list(SAMPLE))
        if missing or not found:
            where = args.torch_tests or "MPX_TORCH_TESTS is not set"
            print(
                f"torch test files: SKIPPED, not a pass: the sample's files ({', '.join(missing)}) "
                f"are not found ({where}); set MPX_TORCH_TESTS to torch's test/ folder to run them"
            )
            return 0
    else:
        found, missing = find_files(args.torch_tests, args.files)
    if missing:
        where = args.torch_tests or "(no --torch-tests, no MPX_TORCH_TESTS)"
        print(
            f"torch's test sources are not here: {', '.join(missing)} not found under {where}. "
            "They are not in the torch wheel: clone torch at the installed version's tag and "
            "pass its test/ folder as --torch-tests (or MPX_TORCH_TESTS)."
        )
    if not found:
        print("torch test files: none run")
        return 0
    harness = _harness()
    out = args.out.resolve()
    regressed: list[str] = []
    lines = []
    for path in found:
        if args.sample:  # named: no listing run (a torch import fewer)
            tests = list(next(v for k, v in SAMPLE.items() if path.as_posix().endswith(k)))
        else:
            tests = _tests_of(path)
        if args.pattern:
            tests = [t for t in tests if re.search(args.pattern, t)]
        if not tests:
            continue
        for ranks in args.ranks:
            line, failed = _compare_at(harness, path, tests, ranks, out)
            lines.append(line)
            regressed += failed
    print("\n".join(lines))
    if regressed:
        print(f"mpx fails {len(regressed)} test(s) that gloo passes: {regressed}")
        return 1
    return 0


def _compare_at(
    harness: ModuleType, path: Path, tests: list[str], ranks: int, out: Path
) -> tuple[str, list[str]]:
    """Runs ``tests`` of ``path`` at ``ranks`` on gloo and mpx: its line, its regressions."""
    results = {
        backend: harness.run_backend(
            backend,
            tests,
            ranks,
            out / f"{path.stem}-{backend}-{ranks}",
            ["--file", str(path)],
            HERE / "driver_files.py",
        )
        for backend in ("gloo", "mpx")
    }
    from driver_files import NOT_ON_MPX  # type: ignore[import-not-found]

    result = compare_file(results["gloo"], results["mpx"], NOT_ON_MPX)
    (out / f"summary-{path.stem}-{ranks}.json").write_text(
        json.dumps(result, indent=1, sort_keys=True)
    )
    line = (
        f"{path.name}, {ranks} ranks: mpx passes {result['passes']} of the "
        f"{result['control_passes']} tests gloo passes"
        f" ({len(result['not_on_tested'])} make no mpx group: gloo's classes, another"
        f" backend or none; {len(result['gloo_api'])} call gloo's own API on the group)"
    )
    print(line)
    for test in result["gloo_api"]:
        print(f"  gloo-api {test}: calls ProcessGroupGloo's create_device on the group")
    for text in harness.difference_lines(result, harness.EXPECTED_DIFFER, "gloo"):
        print(text)
    failed = harness.regressions(result, harness.EXPECTED_DIFFER)
    return line, [f"{path.name}::{t}" for t in failed]


def run_sample(ranks: int, out: Path) -> int:
    """The fixed sample at ``ranks``, torch's sources from ``MPX_TORCH_TESTS``: the exit status."""
    return main(["--sample", "--ranks", str(ranks), "--out", str(out)])


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main())
