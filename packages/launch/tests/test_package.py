"""mpx-launch as a package: what only it has (the version and layer checks of every package are
tests/test_package_layers.py, written once)."""

from __future__ import annotations

from importlib import metadata


def _hard_requirements() -> list[str]:
    return [r for r in metadata.requires("mpx-launch") or [] if "extra ==" not in r]


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
