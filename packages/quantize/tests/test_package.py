"""mpx-quantize installs, imports, and depends only on the layers below it."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib

import mpx.quantize

# The mpx packages this layer may require (extras excluded): DESIGN.md's layers.
ALLOWED_MPX_DEPENDENCIES: set[str] = {"mpx-launch"}  # dependency-free: the settings table


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-quantize") or [] if "extra ==" not in r]


def test_version_matches_the_distribution() -> None:
    assert mpx.quantize.__version__ == metadata.version("mpx-quantize")


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


def test_torch_cgx_is_a_module_of_the_wheel_that_registers_cgx_without_mpi() -> None:
    """CGX scripts start with ``import torch_cgx``: a ModuleNotFoundError (issue 31)."""
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "src/torch_cgx" in pyproject["tool"]["scikit-build"]["wheel"]["packages"]
    code = (
        "import sys, torch_cgx, torch.distributed as dist\n"
        "print('cgx' in dist.Backend.backend_list, 'mpi4py' in sys.modules,\n"
        "      callable(torch_cgx.register_model), callable(torch_cgx.exclude_layer))\n"
    )
    # without torch's entry-point autoload: import torch_cgx itself registers "cgx"
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}
    seen = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert seen.stdout.split() == ["True", "False", "True", "True"]
