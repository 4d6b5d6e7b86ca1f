"""Each package README's "## Layout" tree names the subpackages the package really has.

Issue 57: a package with more than one role is a package of subpackages, one
per role, and its README draws them. The tree is the first fenced ``text``
block after the line ``## Layout`` (before the next ``## `` heading)::

    ```text
    mpx/<name>/
    ├── __init__.py      the public API
    ├── errors.py        a module: one line, its name, two spaces or more, what it holds
    ├── schedules/       a subpackage: its name ends with "/"
    │   └── orders.py    an entry inside schedules/ (indented by "│   " or "    ")
    └── runtime/         the last entry of a folder starts with "└── "
    ```

The first line is ``mpx/<name>/``. Every other line is an entry: indentation
units of four characters (``"│   "`` or ``"    "``), one per folder level, then
``"├── "`` or ``"└── "``, the entry's name, at least two spaces and a
description. Checked against ``packages/<name>/src/mpx/<name>``:

* the folders at the top level are exactly the package's subpackages (folders
  with an ``__init__.py``): a subpackage added or removed must be drawn;
* a folder that lists entries of its own lists all of its subpackages;
* every module named (``*.py``) exists where the tree puts it;
* every entry says what it holds.

Modules need not all be named (the tree shows roles, not every file).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The packages whose README draws a Layout tree (issue 57).
PACKAGES_WITH_LAYOUT = ["collectives", "dataparallel", "launch", "mgrit", "pipeline", "quantize"]

_ENTRY = re.compile(r"^(?P<indent>(?:│   |    )*)(?:├── |└── )(?P<name>\S+)(?P<rest>.*)$")


def _tree(readme: str) -> list[str]:
    """The lines of the Layout section's ``text`` block; [] if there is none."""
    section = re.search(r"^## Layout[ \t]*\n(.*?)(?=^## |\Z)", readme, re.DOTALL | re.MULTILINE)
    if section is None:
        return []
    block = re.search(r"^```text\n(.*?)^```", section[1], re.DOTALL | re.MULTILINE)
    return block[1].splitlines() if block else []


def _subpackages(folder: Path) -> set[str]:
    return {p.name + "/" for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}


def layout_problems(name: str, readme: str, source: Path) -> list[str]:
    """What is wrong with the Layout tree of package ``name`` (``source``: its mpx/<name>)."""
    lines = _tree(readme)
    if not lines:
        return ["no '## Layout' section with a ```text block"]
    if lines[0].strip() != f"mpx/{name}/":
        return [f"the tree's first line is {lines[0]!r}, not 'mpx/{name}/'"]
    problems: list[str] = []
    listed: dict[Path, set[str]] = {source: set()}
    parents = [source]  # parents[d]: the folder entries at depth d belong to
    for line in lines[1:]:
        entry = _ENTRY.match(line)
        if entry is None:
            problems.append(f"not an entry of the tree: {line!r}")
            continue
        depth = len(entry["indent"]) // 4
        if depth >= len(parents):
            problems.append(f"indented below no folder: {line!r}")
            continue
        del parents[depth + 1 :]
        folder, entry_name = parents[depth], entry["name"]
        if not re.match(r"^ {2,}\S", entry["rest"]):
            problems.append(f"{entry_name}: no description (two spaces, then what it holds)")
        listed.setdefault(folder, set()).add(entry_name)
        where = folder / entry_name.rstrip("/")
        if entry_name.endswith("/"):
            if not (where / "__init__.py").is_file():
                problems.append(f"{entry_name}: no subpackage {where.relative_to(source.parent)}")
            parents.append(where)
        elif not where.is_file():
            problems.append(f"{entry_name}: no module {where.relative_to(source.parent)}")
    for folder, names in listed.items():
        if folder != source and not names:
            continue
        drawn = {n for n in names if n.endswith("/")}
        actual = _subpackages(folder) if folder.is_dir() else set()
        at = folder.relative_to(source.parent)
        problems += [f"{at}: subpackage {n} is not drawn" for n in sorted(actual - drawn)]
        problems += [f"{at}: {n} is drawn but no subpackage" for n in sorted(drawn - actual)]
    return problems


@pytest.mark.parametrize("name", PACKAGES_WITH_LAYOUT)
def test_readme_layout_matches_the_folders(name: str) -> None:
    package = ROOT / "packages" / name
    readme = (package / "README.md").read_text()
    assert layout_problems(name, readme, package / "src" / "mpx" / name) == []


def test_a_wrong_tree_is_caught(tmp_path: Path) -> None:
    """The check fails where it should: a missing, an extra and a misplaced entry."""
    source = tmp_path / "mpx" / "demo"
    for sub in ("roles", "roles/inner", "other"):
        (source / sub).mkdir(parents=True)
        (source / sub / "__init__.py").write_text("")
    (source / "roles" / "a.py").write_text("")
    good = (
        "## Layout\n\n```text\nmpx/demo/\n├── roles/  the roles\n│   ├── inner/  inner one\n"
        "│   └── a.py  a module\n└── other/  the other\n```\n\n## Next\n"
    )
    assert layout_problems("demo", good, source) == []
    wrong = (
        "## Layout\n\n```text\nmpx/demo/\n├── roles/  the roles\n│   └── b.py  a module\n"
        "├── gone/  not there\n└── a.py\n```\n"
    )
    problems = layout_problems("demo", wrong, source)
    assert any("other/ is not drawn" in p for p in problems), problems
    assert any("gone/ is drawn but no subpackage" in p for p in problems), problems
    assert any("b.py: no module" in p for p in problems), problems
    assert any("inner/ is not drawn" in p for p in problems), problems
    assert any("a.py: no description" in p for p in problems), problems
    assert layout_problems("demo", "# no layout\n", source) != []
