"""mpx-collectives installs, imports, and depends only on the layers below it."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import mpx.collectives
from mpx.collectives import fast_path

# The mpx packages this layer may require (extras excluded): DESIGN.md's layers.
ALLOWED_MPX_DEPENDENCIES: set[str] = {"mpx-launch"}  # dependency-free: mpxrun, settings


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-collectives") or [] if "extra ==" not in r]


def test_version_matches_the_distribution() -> None:
    assert mpx.collectives.__version__ == metadata.version("mpx-collectives")


def test_is_a_pep_420_namespace_package() -> None:
    # No src/mpx/__init__.py anywhere: every mpx package shares the namespace.
    assert getattr(importlib.import_module("mpx"), "__file__", None) is None


def test_requires_only_lower_layers() -> None:
    names = {re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0] for r in _hard_requirements()}
    assert {n for n in names if n.startswith("mpx-")} == ALLOWED_MPX_DEPENDENCIES
    for requirement in _hard_requirements():
        if requirement.startswith("mpx-"):
            assert ">=0.1" in requirement, requirement
            assert "<0.2" in requirement, requirement


def test_ships_its_type_marker_and_compiled_declarations() -> None:
    files = {str(f) for f in metadata.files("mpx-collectives") or []}
    if "mpx/collectives/__init__.py" not in files:
        pytest.skip("an editable install: the files are the source tree's")
    assert "mpx/collectives/py.typed" in files
    assert "mpx/collectives/fast_path.pxd" in files
    assert "mpx/_collectives_autoload.py" in files  # the torch.backends entry point


def test_compiled_fast_path_is_not_older_than_its_source() -> None:
    """An editable install compiles in place: an edit to the .py needs a rebuild to count."""
    if not fast_path.COMPILED:
        pytest.skip("fast_path runs as Python (not compiled): nothing can be stale")
    compiled = Path(str(fast_path.__file__))
    if not (compiled.parents[3] / "setup.py").exists():
        pytest.skip("installed from a wheel: source and module were installed together")
    for source in (compiled.with_name("fast_path.py"), compiled.with_name("fast_path.pxd")):
        assert source.stat().st_mtime <= compiled.stat().st_mtime, (
            f"{source.name} changed after {compiled.name} was built, and Python loads the "
            "compiled module: rebuild it with `pip install -e packages/collectives` (or "
            "build with MPX_COLLECTIVES_CYTHON=OFF to develop on the Python module)"
        )


def test_import_torch_registers_mpx_without_starting_mpi() -> None:
    """The ``torch.backends`` entry point: ``mpx`` is known after ``import torch`` alone."""
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "print('mpx' in dist.Backend.backend_list, 'mpi4py' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    seen = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert seen.stdout.split() == ["True", "False"]
    env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # torch's switch turns it off
    seen = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert seen.stdout.split() == ["False", "False"]
