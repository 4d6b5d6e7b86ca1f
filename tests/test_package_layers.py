"""Every mpx package installs, imports, and requires only the layers below it.

One test over the six packages (mpi4py's way: written once), reading the
layers from the import-linter contract in pyproject.toml, the one place they
are declared. What only one package has (launch runs without torch,
collectives' entry point, quantize's ``torch_cgx``) stays in that package's
own ``tests/test_package.py``.
"""

from __future__ import annotations

import ast
import importlib
import re
from importlib import metadata
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _layers() -> list[set[str]]:
    """The layers contract's layers, top first, as distribution names (mpx-pipeline).

    The contract between the packages: the layers contracts with ``containers``
    are each the layers inside one package (issue 57), not between packages.
    """
    (contract,) = (
        c
        for c in PYPROJECT["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers" and "containers" not in c
    )
    return [
        {"mpx-" + module.strip().removeprefix("mpx.") for module in layer.split("|")}
        for layer in contract["layers"]
    ]


LAYERS = _layers()
PACKAGES = sorted(name for layer in LAYERS for name in layer)


def _below(package: str) -> set[str]:
    (index,) = (i for i, layer in enumerate(LAYERS) if package in layer)
    return set().union(*LAYERS[index + 1 :])


def _requirements(package: str) -> tuple[dict[str, str], dict[str, str]]:
    """The mpx requirements, {name: requirement}: the hard ones and those of extras."""
    hard: dict[str, str] = {}
    extra: dict[str, str] = {}
    for requirement in metadata.requires(package) or []:
        name = re.split(r"[ ;<>=!~\[]", requirement, maxsplit=1)[0]
        if name.startswith("mpx-"):
            (extra if "extra ==" in requirement else hard)[name] = requirement
    return hard, extra


def _imported_packages(package: str) -> set[str]:
    """The other mpx distributions the package's sources import (any import statement)."""
    module = importlib.import_module(package.replace("-", "."))
    found: set[str] = set()
    for directory in module.__path__:
        for source in Path(directory).rglob("*.py"):
            for node in ast.walk(ast.parse(source.read_text())):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                elif (  # importlib.import_module("mpx.quantize"): an optional layer
                    isinstance(node, ast.Call)
                    and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str)
                ):
                    names = [node.args[0].value]
                else:
                    continue
                found.update(
                    "mpx-" + n.split(".")[1] for n in names if n.startswith("mpx.") and "." in n
                )
    return found - {package}


def test_the_layers_name_every_package() -> None:
    shipped = sorted("mpx-" + p.name for p in (ROOT / "packages").iterdir() if p.is_dir())
    assert shipped == PACKAGES


def test_mpx_is_a_pep_420_namespace_package() -> None:
    # No src/mpx/__init__.py anywhere: every mpx package shares the namespace.
    assert getattr(importlib.import_module("mpx"), "__file__", None) is None


@pytest.mark.parametrize("package", PACKAGES)
def test_version_matches_the_distribution(package: str) -> None:
    module = importlib.import_module(package.replace("-", "."))
    assert module.__version__ == metadata.version(package)


@pytest.mark.parametrize("package", PACKAGES)
def test_requires_only_lower_layers_in_their_release_series(package: str) -> None:
    hard, extra = _requirements(package)
    assert set(hard) | set(extra) <= _below(package), (package, hard, extra)
    for name, requirement in [*hard.items(), *extra.items()]:
        major, minor = metadata.version(name).split(".")[:2]
        # The sibling's release series: this version and later, below the next minor.
        assert f">={major}.{minor}" in requirement, requirement
        assert f"<{major}.{int(minor) + 1}" in requirement, requirement


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_only_what_it_requires(package: str) -> None:
    """An import of a sibling the metadata does not name fails at a user's site only."""
    hard, extra = _requirements(package)
    assert _imported_packages(package) <= set(hard) | set(extra), package


def test_the_whole_product_tests_hold_no_mpi_test() -> None:
    """noxfile runs the mpi-marked tests per package (MPI_TEST_PATHS): one in tests/
    would never run."""

    def mpi_marked(source: str) -> bool:
        for node in ast.walk(ast.parse(source)):
            marks: list[ast.expr] = []
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                marks = [node.value]
            elif isinstance(node, ast.FunctionDef):
                marks = list(node.decorator_list)
            if any("mark.mpi" in ast.unparse(mark) for mark in marks):
                return True
        return False

    marked = [p.name for p in (ROOT / "tests").rglob("test_*.py") if mpi_marked(p.read_text())]
    assert marked == [], f"move these to a package's tests, or run tests/ under mpxrun: {marked}"


def private_reaches(package_dir: Path, name: str) -> list[str]:
    """Imports of ``mpx.<name>.<sub>.<module>`` from outside subpackage ``<sub>``.

    Issue 57: a subpackage's names are used from outside it only through its
    ``__init__``, so its modules can move and split without touching the rest.
    ``package_dir`` is ``.../mpx/<name>``; returns ``"file: module"`` lines.
    """
    subpackages = {p.name for p in package_dir.iterdir() if (p / "__init__.py").is_file()}
    found = []
    for source in sorted(package_dir.rglob("*.py")):
        inside = source.relative_to(package_dir).parts[0]
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                if (
                    len(parts) >= 4
                    and parts[:2] == ["mpx", name]
                    and parts[2] in subpackages
                    and parts[2] != inside
                ):
                    found.append(f"{source.relative_to(package_dir)}: {module}")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_subpackages_are_entered_through_their_init(package: str) -> None:
    name = package.removeprefix("mpx-")
    assert private_reaches(ROOT / "packages" / name / "src" / "mpx" / name, name) == []


def test_a_reach_inside_a_subpackage_is_caught(tmp_path: Path) -> None:
    package = tmp_path / "mpx" / "demo"
    (package / "core").mkdir(parents=True)
    (package / "core" / "__init__.py").write_text("from mpx.demo.core.engine import run\n")
    (package / "core" / "engine.py").write_text("run = 1\n")
    (package / "api.py").write_text("from mpx.demo.core import run\n")
    assert private_reaches(package, "demo") == []
    (package / "top.py").write_text("import mpx.demo.core.engine\n")
    (package / "other.py").write_text("from mpx.demo.core.engine import run\n")
    assert private_reaches(package, "demo") == [
        "other.py: mpx.demo.core.engine",
        "top.py: mpx.demo.core.engine",
    ]
