"""tools/release.py on a scratch repository: version, changelog, commit and tag."""

from __future__ import annotations

import datetime
import importlib.util
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TODAY = datetime.date(2026, 11, 23)


def _release_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("release", ROOT / "tools" / "release.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


release = _release_module()


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The six packages' pyproject.toml and CHANGELOG.md as committed here, in a new git repo."""
    for name in release.PACKAGES:
        package = tmp_path / "packages" / name
        package.mkdir(parents=True)
        for page in ("pyproject.toml", "CHANGELOG.md"):
            (package / page).write_text((ROOT / "packages" / name / page).read_text())
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", ".")
    _git(tmp_path, "commit", "-q", "-m", "start")
    return tmp_path


def test_release_writes_version_changelog_commit_and_tag(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GIT_AUTHOR_NAME", "t")
    monkeypatch.setenv("GIT_AUTHOR_EMAIL", "t@example.invalid")
    monkeypatch.setenv("GIT_COMMITTER_NAME", "t")
    monkeypatch.setenv("GIT_COMMITTER_EMAIL", "t@example.invalid")
    tag = release.release(repo, "pipeline", "0.1.1", TODAY)
    assert tag == "pipeline-v0.1.1"
    assert 'version = "0.1.1"' in (repo / "packages/pipeline/pyproject.toml").read_text()
    log = (repo / "packages/pipeline/CHANGELOG.md").read_text()
    assert "## Unreleased\n\n## 0.1.1 (2026-11-23)\n" in log
    assert "(unreleased)" not in log
    assert _git(repo, "tag", "--list").split() == ["pipeline-v0.1.1"]
    assert _git(repo, "status", "--porcelain").strip() == ""
    # The new Unreleased section is empty: a second release has nothing to release.
    with pytest.raises(release.ReleaseError, match="no entries"):
        release.plan(repo, "pipeline", "0.1.2", TODAY)


def test_release_refused_outside_a_siblings_range(repo: Path) -> None:
    # mpx-pipeline requires mpx-collectives>=0.1,<0.2.
    with pytest.raises(release.ReleaseError, match=r"mpx-\w+ requires mpx-collectives.*widen"):
        release.plan(repo, "collectives", "0.2.0", TODAY)


def test_release_refused_below_the_current_version(repo: Path) -> None:
    with pytest.raises(release.ReleaseError, match="cannot go below"):
        release.plan(repo, "launch", "0.0.9", TODAY)


def test_first_release_of_the_current_version_then_not_again(
    repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for variable in ("GIT_AUTHOR_NAME", "GIT_COMMITTER_NAME"):
        monkeypatch.setenv(variable, "t")
    for variable in ("GIT_AUTHOR_EMAIL", "GIT_COMMITTER_EMAIL"):
        monkeypatch.setenv(variable, "t@example.invalid")
    assert release.release(repo, "mgrit", "0.1.0", TODAY) == "mgrit-v0.1.0"
    assert "## 0.1.0 (2026-11-23)" in (repo / "packages/mgrit/CHANGELOG.md").read_text()
    with pytest.raises(release.ReleaseError, match="exists already"):
        release.release(repo, "mgrit", "0.1.0", TODAY)


def test_release_refused_on_a_dirty_tree(repo: Path) -> None:
    (repo / "packages/launch/CHANGELOG.md").write_text("edited\n")
    with pytest.raises(release.ReleaseError, match="uncommitted"):
        release.release(repo, "launch", "0.1.1", TODAY)
