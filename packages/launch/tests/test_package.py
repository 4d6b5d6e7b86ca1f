"""mpx-launch installs, imports, and depends only on the layers below it."""

from __future__ import annotations

import importlib
import re
from importlib import metadata

import mpx.launch

# The mpx packages this layer may require (extras excluded): DESIGN.md's layers.
ALLOWED_MPX_DEPENDENCIES: set[str] = set()


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-launch") or [] if "extra ==" not in r]


def test_version_matches_the_distribution() -> None:
    assert mpx.launch.__version__ == metadata.version("mpx-launch")


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


def test_needs_neither_torch_nor_mpi4py() -> None:
    import subprocess
    import sys

    assert not any(r.startswith(("torch", "mpi4py")) for r in _hard_requirements())
    # Every module of the package (not __main__, which would run mpxrun): the import
    # contract (pyproject.toml) sees launch's own imports; this also catches a
    # third-party module that pulls torch in.
    code = (
        "import importlib, pkgutil, sys, mpx.launch\n"
        "for m in pkgutil.walk_packages(mpx.launch.__path__, 'mpx.launch.'):\n"
        "    if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "bad = [n for n in sys.modules if n.split('.')[0] in ('torch', 'mpi4py', 'numpy')\n"
        "       or (n.startswith('mpx.') and not n.startswith('mpx.launch'))]\n"
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
