"""The torch releases the packages declare are the ones the sessions test.

``nox -s tests`` runs on constraints.txt's torch pin and ``nox -s tests-torch-newer``
on the noxfile's TORCH_NEWER: every torch-using package must declare
``torch>=`` that pin (no lower: a bound no test has run is a promise nobody
checked), and the newer release must be newer than the pin.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
TORCH_PACKAGES = ["collectives", "quantize", "mgrit", "pipeline", "dataparallel"]


def _pinned_torch() -> Version:
    text = (ROOT / "constraints.txt").read_text()
    match = re.search(r"(?m)^torch==([\w.+]+)$", text)
    assert match is not None, "constraints.txt pins no torch"
    return Version(Version(match.group(1)).base_version)


def _noxfile_constant(name: str) -> str:
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            value = ast.literal_eval(node.value)
            assert isinstance(value, str)
            return value
    raise AssertionError(f"noxfile.py has no {name}")


def test_each_package_declares_the_oldest_torch_a_session_tests() -> None:
    pinned = _pinned_torch()
    for name in TORCH_PACKAGES:
        with (ROOT / "packages" / name / "pyproject.toml").open("rb") as file:
            project = tomllib.load(file)["project"]
        torch = [Requirement(r) for r in project["dependencies"] if Requirement(r).name == "torch"]
        assert len(torch) == 1, f"mpx-{name} declares torch {len(torch)} times"
        lower = [Version(s.version) for s in torch[0].specifier if s.operator == ">="]
        assert lower == [pinned], (
            f"mpx-{name} declares {torch[0]}: its lower bound must be torch {pinned}, the "
            "release nox -s tests runs (constraints.txt)"
        )


def test_the_newer_torch_session_tests_a_newer_release() -> None:
    newer = Version(_noxfile_constant("TORCH_NEWER"))
    assert newer > _pinned_torch()
    assert '@nox.session(name="tests-torch-newer"' in (ROOT / "noxfile.py").read_text()
