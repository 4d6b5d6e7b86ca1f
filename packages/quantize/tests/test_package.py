"""mpx-quantize as a package: what only it has (the version and layer checks of every package are
tests/test_package_layers.py, written once)."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import tomllib


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-quantize") or [] if "extra ==" not in r]


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
