"""Sessions for the mpx monorepo.

    nox -s tests       unit tests, the mpi tests under mpxrun -n 1, 2, 3, and a subset
                       of PyTorch's distributed suite on mpx against gloo (2 ranks)
    nox -s tests-gpu   CUDA build ON, the gpu-marked tests (default where nvidia-smi exists)
    nox -s lint        ruff, mypy, and the import contract (import-linter)
    nox -s bench       every package's benchmarks, tables into BENCHMARKS.md
    nox -s demo        the main job: distributed training on scikit-learn's digits

Every session installs from constraints.txt (torch pinned to the CPU build).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import nox

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
# Bottom layers first, so that pip sees each sibling before it is needed.
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
RANK_COUNTS = (1, 2, 3)
TEST_DEPS = ["torch", "numpy", "mpi4py", "mpich", "pytest", "pytest-timeout", "scikit-learn"]
TEST_DEPS += ["matplotlib"]  # the examples' plots, run by the tests
TEST_DEPS += ["pymgrit"]  # mpx-mgrit: the reference solver of its tests
# Wall-clock limit of one multi-rank pytest run; each test has its own (300 s).
MPI_RUN_TIMEOUT_S = "1200"
HAS_GPU = shutil.which("nvidia-smi") is not None

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True


def _install(session: nox.Session, *extra: str, cuda: str = "OFF") -> None:
    session.install("-c", CONSTRAINTS, *TEST_DEPS, *extra)
    session.install(
        "-c",
        CONSTRAINTS,
        *[str(ROOT / "packages" / name) for name in PACKAGES],
        env={"MPX_QUANTIZE_CUDA": cuda},
    )


def _timed(session: nox.Session, label: str, *args: str, **kwargs: object) -> None:
    start = time.monotonic()
    session.run(*args, **kwargs)  # type: ignore[arg-type]
    session.log(f"{label}: {time.monotonic() - start:.1f} s")


# tests/: whole-product tests (the docs' snippets under mpxrun).
TEST_PATHS = [f"packages/{name}/tests" for name in PACKAGES] + ["tests"]


def _mpi_runs(session: nox.Session, marker: str, **kwargs: object) -> None:
    """The tests selected by ``marker`` under mpxrun with 1, 2 and 3 ranks."""
    for nprocs in RANK_COUNTS:
        _timed(
            session,
            f"{marker} tests on {nprocs} rank(s)",
            "mpxrun",
            "-n",
            str(nprocs),
            "--timeout",
            MPI_RUN_TIMEOUT_S,
            "--",
            "python",
            "-m",
            "pytest",
            *TEST_PATHS,
            "-m",
            marker,
            *session.posargs,
            **kwargs,
        )


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests of all packages, the mpi tests under 1, 2 and 3 ranks, a conformance smoke."""
    _install(session, "expecttest")  # torch's distributed test suite imports it
    # pytest exits 5 when it collects nothing: session.run fails on it, as it should.
    _timed(
        session,
        "unit tests",
        "python",
        "-m",
        "pytest",
        *TEST_PATHS,
        "-m",
        "not mpi and not gpu",
        *session.posargs,
    )
    _mpi_runs(session, "mpi and not gpu")
    # PyTorch's own distributed suite, a cheap subset on 2 ranks: fails when mpx
    # fails a test that gloo passes (`nox -s torch-conformance` runs all of it).
    _timed(
        session,
        "torch conformance smoke",
        "python",
        "tests/conformance/run_conformance.py",
        "--ranks",
        "2",
        "--select",
        "smoke",
    )


@nox.session(name="tests-gpu", default=HAS_GPU)
def tests_gpu(session: nox.Session) -> None:
    """CUDA build ON; the gpu-marked tests, single- and multi-rank."""
    _install(session, cuda="ON")
    env = {"MPX_REQUIRE_GPU": "1"}
    _timed(
        session,
        "gpu unit tests",
        "python",
        "-m",
        "pytest",
        *TEST_PATHS,
        "-m",
        "gpu and not mpi",
        *session.posargs,
        env=env,
    )
    _mpi_runs(session, "gpu and mpi", env=env)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check), mypy (strict), and the import contract."""
    _install(session, "ruff", "mypy", "matplotlib", "import-linter")
    targets = ["packages", "examples", "tests", "noxfile.py", "conftest.py"]
    session.run("ruff", "check", *targets)
    session.run("ruff", "format", "--check", *targets)
    sources = [f"packages/{name}/src/mpx/{name}" for name in PACKAGES]
    # Tests and benchmarks too, in the same run: the root pyproject.toml's
    # explicit_package_bases names them by path (packages.quantize.tests.test_package),
    # so the test_package.py of every package stays a module of its own.
    checks = [f"packages/{name}/{part}" for name in PACKAGES for part in ("tests", "benchmarks")]
    session.run("mypy", *sources, "examples", *checks, "tests", "conftest.py")
    # The layer rules and "no private imports across packages" ([tool.importlinter]
    # in pyproject.toml), checked on this working tree: the sources come first on
    # the path, ahead of the copies installed into the session.
    src_path = os.pathsep.join(str(ROOT / "packages" / name / "src") for name in PACKAGES)
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": src_path})


BENCH_BEGIN = "<!-- bench:{name} begin -->"
BENCH_END = "<!-- bench:{name} end -->"


def _update_benchmarks_md(name: str, table: str) -> None:
    path = ROOT / "BENCHMARKS.md"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    begin, end = BENCH_BEGIN.format(name=name), BENCH_END.format(name=name)
    block = f"{begin}\n{table.strip()}\n{end}"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.DOTALL)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else f"{text.rstrip()}\n\n{block}\n"
    )
    path.write_text(text)


@nox.session(default=False)
def bench(session: nox.Session) -> None:
    """Runs every packages/*/benchmarks/*.py; each prints a markdown section.

    ``nox -s bench -- NAME`` runs only the benchmarks whose path contains NAME.
    """
    _install(session, "matplotlib")
    for script in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py")):
        name = f"{script.parent.parent.name}/{script.stem}"
        if session.posargs and not any(arg in name for arg in session.posargs):
            continue
        output = session.run("python", str(script), silent=True)
        assert isinstance(output, str)
        print(output)
        _update_benchmarks_md(name, output)


@nox.session(default=False)
def demo(session: nox.Session) -> None:
    """The main job: `mpxrun -n 2` data-parallel training on scikit-learn's digits."""
    _install(session, "matplotlib")
    args = session.posargs or []
    nprocs = os.environ.get("MPX_DEMO_RANKS", "2")
    session.run(
        "mpxrun",
        "-n",
        nprocs,
        "--timeout",
        "900",
        "--",
        "python",
        "examples/train_digits.py",
        *args,
    )


@nox.session(name="torch-conformance", default=False)
def torch_conformance(session: nox.Session) -> None:
    """PyTorch's own distributed suite on `mpx`, gloo the control: 2 ranks, subgroups on 3.

    Prints "mpx passes X of the Y tests that gloo passes" and the differences;
    the JSON results go to conformance-results/. Extra arguments go to
    tests/conformance/run_conformance.py (e.g. `-- -k all_reduce`).
    """
    _install(session, "expecttest")  # torch's test utilities import it
    script = "tests/conformance/run_conformance.py"
    session.run("python", script, "--ranks", "2", *session.posargs)
    session.run("python", script, "--ranks", "3", "--select", "subgroup", *session.posargs)
