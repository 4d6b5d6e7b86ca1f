"""Packaging rules of the six packages, checked on the source tree.

Versions: each package's version is written once, in its pyproject.toml; the
``__version__`` of its module is read from the installed metadata at run time.
Metadata: every pyproject has the project URLs, the classifiers and keywords a
package index shows, and a LICENSE beside it that equals the repository's.
"""

from __future__ import annotations

import ast
import importlib.util
import zipfile
from pathlib import Path

import pytest
import tomllib

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


@pytest.mark.parametrize("name", PACKAGES)
def test_metadata_for_the_index(name: str) -> None:
    project = _pyproject(name)
    classifiers = project["classifiers"]
    assert isinstance(classifiers, list)
    assert "Typing :: Typed" in classifiers
    assert (ROOT / "packages" / name / "src" / "mpx" / name / "py.typed").exists()
    tested = [c for c in classifiers if c.startswith("Programming Language :: Python :: 3.")]
    lowest = str(project["requires-python"]).removeprefix(">=")
    assert tested, classifiers
    assert tested[0].endswith(f":: {lowest}"), (tested, lowest)
    urls = project["urls"]
    assert isinstance(urls, dict)
    assert {"Homepage", "Source", "Changelog", "Issues"} <= set(urls)
    assert project["keywords"]
    assert project["license-files"] == ["LICENSE"]
    license_file = ROOT / "packages" / name / "LICENSE"
    assert license_file.read_text() == (ROOT / "LICENSE").read_text(), license_file


def test_wheel_check_names_what_a_wheel_lacks(tmp_path: Path) -> None:
    """check_dists (run by ``nox -s build`` on dist/) flags a bare linux wheel."""
    spec = importlib.util.spec_from_file_location(
        "check_dists", ROOT / "tests" / "wheelhouse" / "check_dists.py"
    )
    assert spec is not None
    assert spec.loader is not None
    check_dists = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check_dists)
    wheel_problems = check_dists.wheel_problems
    wheel = tmp_path / "mpx_pipeline-0.1.0-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("mpx/pipeline/__init__.py", "")
        archive.writestr(
            "mpx_pipeline-0.1.0.dist-info/METADATA",
            "Metadata-Version: 2.4\nName: mpx-pipeline\nVersion: 0.1.0\n"
            "Classifier: Programming Language :: Python :: 3\n",
        )
    problems = "\n".join(wheel_problems(wheel))
    for lack in ("LICENSE", "py.typed", "Typing :: Typed", "Project-URL", "Keywords"):
        assert lack in problems
    assert "linux_x86_64: repair it with auditwheel" in problems
