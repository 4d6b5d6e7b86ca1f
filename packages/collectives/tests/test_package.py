"""mpx-collectives as a package: what only it has (the version and layer checks of every package are
tests/test_package_layers.py, written once)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from mpx.collectives.core import fast_path


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-collectives") or [] if "extra ==" not in r]


def test_ships_its_type_marker_and_compiled_declarations() -> None:
    files = {str(f) for f in metadata.files("mpx-collectives") or []}
    if "mpx/collectives/__init__.py" not in files:
        pytest.skip("an editable install: the files are the source tree's")
    assert "mpx/collectives/py.typed" in files
    assert "mpx/collectives/core/fast_path.pxd" in files
    assert "mpx/_collectives_autoload.py" in files  # the torch.backends entry point


def test_compiled_fast_path_is_not_older_than_its_source() -> None:
    """An editable install compiles in place: an edit to the .py needs a rebuild to count."""
    if not fast_path.COMPILED:
        pytest.skip("fast_path runs as Python (not compiled): nothing can be stale")
    compiled = Path(str(fast_path.__file__))
    if not (compiled.parents[4] / "setup.py").exists():  # src/mpx/collectives/core/
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
