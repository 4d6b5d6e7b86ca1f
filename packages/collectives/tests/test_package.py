"""mpx-collectives installs, imports, and depends only on the layers below it."""

from __future__ import annotations

import importlib
import re
from importlib import metadata

import mpx.collectives

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
