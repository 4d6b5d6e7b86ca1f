"""Releases one package: its version, its changelog, a commit and the tag ``<name>-v<version>``.

    python tools/release.py pipeline 0.2.0 [--dry-run]      (or: nox -s release -- pipeline 0.2.0)

The version lives in one place, ``packages/<name>/pyproject.toml`` (the module's
``__version__`` reads the installed metadata). The release:

1. refuses a dirty work tree, a version below the current one or already tagged, and a version
   that a sibling's dependency range leaves out (``mpx-collectives>=0.1,<0.2``
   with collectives 0.2.0: widen the sibling's range first, in a release of its own);
2. writes the version into pyproject.toml;
3. turns the changelog's ``## Unreleased`` (or ``## X.Y.Z (unreleased)``) heading
   into ``## <version> (<date>)`` and opens a new empty ``## Unreleased`` above it
   (no entries under it: nothing to release, refused);
4. commits both files and tags the commit ``<name>-v<version>`` (annotated).

Pushing the tag and uploading ``dist/`` (``nox -s build``; ``twine upload
dist/mpx_<name>-<version>*``) stay manual steps.
"""

from __future__ import annotations

import argparse
import datetime
import difflib
import re
import subprocess
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

__all__ = ["ReleaseError", "main", "plan", "release"]

PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]
UNRELEASED = re.compile(
    r"^## (?:Unreleased|\S+ \(unreleased\))[ \t]*$", re.MULTILINE | re.IGNORECASE
)
VERSION_LINE = re.compile(r'^version = "([^"]+)"$', re.MULTILINE)


class ReleaseError(RuntimeError):
    """A release that must not happen; the message says why and what to do."""


def _project(root: Path, name: str) -> dict[str, object]:
    with (root / "packages" / name / "pyproject.toml").open("rb") as file:
        project = tomllib.load(file)["project"]
    assert isinstance(project, dict)
    return project


def _git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=root, capture_output=True, text=True, check=True
    ).stdout


def plan(root: Path, name: str, version: str, today: datetime.date) -> dict[Path, str]:
    """The new text of each file the release changes; raises ReleaseError if it must not."""
    if name not in PACKAGES:
        raise ReleaseError(f"unknown package {name!r}: one of {', '.join(PACKAGES)}")
    new = Version(version)
    current = Version(str(_project(root, name)["version"]))
    # Equal is allowed: the first release of the version pyproject.toml holds
    # ("## 0.1.0 (unreleased)"); release() refuses a version whose tag exists.
    if new < current:
        raise ReleaseError(f"mpx-{name} is at {current}: the release cannot go below it to {new}")
    for sibling in PACKAGES:
        dependencies = _project(root, sibling).get("dependencies", [])
        assert isinstance(dependencies, list)
        for text in dependencies:
            requirement = Requirement(text)
            if requirement.name == f"mpx-{name}" and new not in requirement.specifier:
                raise ReleaseError(
                    f"mpx-{sibling} requires {requirement}, which leaves out {new}: "
                    f"widen that range (and release mpx-{sibling}) first"
                )
    pyproject = root / "packages" / name / "pyproject.toml"
    text = pyproject.read_text()
    if len(VERSION_LINE.findall(text)) != 1:
        raise ReleaseError(f"{pyproject}: expected one 'version = \"...\"' line")
    changelog = root / "packages" / name / "CHANGELOG.md"
    log = changelog.read_text()
    heading = UNRELEASED.search(log)
    if heading is None:
        raise ReleaseError(f"{changelog} has no '## Unreleased' section: nothing to release")
    following = log.find("\n## ", heading.end())
    entries = log[heading.end() : following if following >= 0 else len(log)]
    if not entries.strip():
        raise ReleaseError(f"{changelog}: '## Unreleased' has no entries: nothing to release")
    released = f"## Unreleased\n\n## {new} ({today.isoformat()})"
    return {
        pyproject: VERSION_LINE.sub(f'version = "{new}"', text),
        changelog: log[: heading.start()] + released + log[heading.end() :],
    }


def release(root: Path, name: str, version: str, today: datetime.date) -> str:
    """Writes, commits and tags the release; returns the tag."""
    if _git(root, "status", "--porcelain", "--untracked-files=no").strip():
        raise ReleaseError("the work tree has uncommitted changes: commit or stash them first")
    tag = f"{name}-v{Version(version)}"
    if _git(root, "tag", "--list", tag).strip():
        raise ReleaseError(f"tag {tag} exists already")
    changes = plan(root, name, version, today)
    for path, text in changes.items():
        path.write_text(text)
    _git(root, "add", *map(str, changes))
    _git(root, "commit", "-q", "-m", f"mpx-{name} {version}")
    _git(root, "tag", "-a", tag, "-m", f"mpx-{name} {version}")
    return tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("package", choices=PACKAGES)
    parser.add_argument("version")
    parser.add_argument("--dry-run", action="store_true", help="print the changes, write nothing")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    today = datetime.datetime.now(datetime.UTC).date()
    try:
        if args.dry_run:
            for path, text in plan(root, args.package, args.version, today).items():
                name = str(path.relative_to(root))
                old = path.read_text().splitlines(keepends=True)
                sys.stdout.writelines(
                    difflib.unified_diff(old, text.splitlines(keepends=True), name, name)
                )
        else:
            print(f"tagged {release(root, args.package, args.version, today)}")
    except ReleaseError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
