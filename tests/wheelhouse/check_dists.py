"""Checks the built distributions in a directory (``nox -s build`` runs it on dist/).

``python check_dists.py DIST``: each of the six packages has exactly one sdist and
one wheel there; each wheel carries its LICENSE, ``py.typed``, the ``Typing ::
Typed`` classifier, project URLs, keywords and requires-python; a binary wheel
has a manylinux tag. Exits non-zero naming every problem.
"""

from __future__ import annotations

import email
import sys
import zipfile
from email.message import Message
from pathlib import Path

PACKAGES = ["launch", "collectives", "quantize", "mgrit", "pipeline", "dataparallel"]


def _metadata(wheel: zipfile.ZipFile) -> tuple[str, Message]:
    dist_info = next(n.split("/")[0] for n in wheel.namelist() if ".dist-info/" in n)
    return dist_info, email.message_from_bytes(wheel.read(f"{dist_info}/METADATA"))


def wheel_problems(path: Path) -> list[str]:
    """What the wheel at ``path`` lacks (empty: nothing)."""
    name = path.name.split("-")[0].removeprefix("mpx_")
    problems = []
    with zipfile.ZipFile(path) as wheel:
        files = set(wheel.namelist())
        dist_info, metadata = _metadata(wheel)
    if f"{dist_info}/licenses/LICENSE" not in files:
        problems.append("no LICENSE in .dist-info/licenses/")
    if f"mpx/{name}/py.typed" not in files:
        problems.append(f"no mpx/{name}/py.typed")
    classifiers = metadata.get_all("Classifier") or []
    if "Typing :: Typed" not in classifiers:
        problems.append("no 'Typing :: Typed' classifier")
    if not any(c.startswith("Programming Language :: Python :: 3.") for c in classifiers):
        problems.append("no classifier of a tested Python version")
    if not metadata.get_all("Project-URL"):
        problems.append("no Project-URL")
    if not metadata.get("Keywords"):
        problems.append("no Keywords")
    if not metadata.get("Requires-Python"):
        problems.append("no Requires-Python")
    if metadata.get("License-Expression") != "BSD-3-Clause":
        problems.append(f"License-Expression {metadata.get('License-Expression')!r}")
    tag = path.stem.split("-")[-1]
    if tag != "any" and not tag.startswith("manylinux"):
        problems.append(f"platform tag {tag}: repair it with auditwheel")
    return [f"{path.name}: {problem}" for problem in problems]


def problems(dist: Path) -> list[str]:
    """Every problem of the distributions in ``dist``."""
    found = []
    for name in PACKAGES:
        stem = f"mpx_{name}-"
        wheels = [p for p in dist.glob(f"{stem}*.whl")]
        sdists = [p for p in dist.glob(f"{stem}*.tar.gz")]
        if len(wheels) != 1 or len(sdists) != 1:
            found.append(f"mpx-{name}: {len(wheels)} wheels, {len(sdists)} sdists (want 1 and 1)")
        for wheel in wheels:
            found.extend(wheel_problems(wheel))
    return found


if __name__ == "__main__":
    listed = problems(Path(sys.argv[1]))
    for problem in listed:
        print(problem, file=sys.stderr)
    sys.exit(1 if listed else 0)
