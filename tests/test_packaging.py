"""Packaging rules of the six packages, checked on the source tree.

Versions: each package's version is written once, in its pyproject.toml; the
``__version__`` of its module is read from the installed metadata at run time.
Metadata: every pyproject has the project URLs, the classifiers and keywords a
package index shows, and a LICENSE beside it that equals the repository's.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]


def _pyproject(name: str) -> dict[str, object]:
    with (ROOT / "packages" / name / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    assert isinstance(project, dict)
    return project


@pytest.mark.parametrize("name", PACKAGES)
def test_version_is_written_once(name: str) -> None:
    """``__version__`` is not a literal: a release changes pyproject.toml only."""
    init = ROOT / "packages" / name / "src" / "mpx" / name / "__init__.py"
    assignments = [
        node
        for node in ast.walk(ast.parse(init.read_text()))
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "__version__" for t in node.targets)
    ]
    assert len(assignments) == 1, f"{init}: one __version__ assignment expected"
    value = assignments[0].value
    assert not isinstance(value, ast.Constant), (
        f"{init}:{value.lineno}: __version__ = {ast.unparse(value)} repeats pyproject.toml's "
        f"version ({_pyproject(name)['version']}); read it with importlib.metadata.version"
    )
