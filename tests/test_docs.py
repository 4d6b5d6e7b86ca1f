"""Every code block of the docs and package READMEs runs as written, or says what it is.

A fenced ``python`` block must be preceded by one of these lines:

* ``<!-- mpx-doc-test: N -->``: the block is run as a script with
  ``mpxrun -n N`` and must exit 0. The snippets assert their own results (equal
  weights across ranks, residuals...), so a page that drifts from the code
  fails here.
* ``<!-- mpx-doc-fragment: examples/NAME.py -->``: the block is part of that
  example: the file exists, a test runs it (its name appears in a test file), and
  the block's code lines appear in it in the same order (comments, blank lines
  and ``...`` lines, which stand for what is left out, aside; indentation aside).
* ``<!-- mpx-doc-other-project: NAME -->``: another project's code (CGX,
  torchbraid...), the "before" of a migration guide; only in docs/migration/.

An unmarked ``python`` block fails, and so does an untagged block that starts
with an import (tag it). In ``bash`` blocks, every path of this repository a
command names (``examples/...py``, ``packages/...``) must exist.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")])
# A fence may be indented (inside a list item); its closing fence has the same indent.
FENCE = re.compile(r"^([ \t]*)```([\w+-]*)[^\n]*\n(.*?)^\1```[ \t]*$", re.DOTALL | re.MULTILINE)
MARKER = re.compile(r"<!-- mpx-doc-(test|fragment|other-project): (\S+) -->")
PYTHON = {"python", "py", "python3"}
SHELL = {"bash", "sh", "shell", "console"}
# A repository path in a command: the folders a user's command can name.
REPO_PATH = re.compile(
    r"(?<![\w./-])(?:\./)?((?:examples|tests|benchmarks|packages|docs|tools)/[\w./-]+)"
)
TEST_FILES = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("packages/*/tests/**/*.py")]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, from 1
    language: str
    code: str
    marker: tuple[str, str] | None  # (kind, argument) of the line before it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip().rsplit("\n", 1)[-1]
        marker = MARKER.fullmatch(before.strip())
        indent = match[1]
        code = "\n".join(line.removeprefix(indent) for line in match[3].splitlines()) + "\n"
        found.append(
            Block(
                page,
                text.count("\n", 0, match.start()) + 1,
                match[2].lower(),
                code,
                (marker[1], marker[2]) if marker else None,
            )
        )
    return found


BLOCKS = [block for page in PAGES for block in _blocks(page)]
SNIPPETS = [b for b in BLOCKS if b.marker and b.marker[0] == "test" and b.language in PYTHON]
FRAGMENTS = [b for b in BLOCKS if b.marker and b.marker[0] == "fragment"]


def _code_lines(code: str) -> list[str]:
    """The lines that carry code: comments cut, indentation stripped, blanks and ``...`` out."""
    lines = (_without_comment(line).strip() for line in code.splitlines())
    return [line for line in lines if line and line != "..."]


def _without_comment(line: str) -> str:
    quote = ""
    for index, char in enumerate(line):
        if quote:
            quote = "" if char == quote and line[index - 1] != "\\" else quote
        elif char in "'\"":
            quote = char
        elif char == "#":
            return line[:index]
    return line


def test_the_pages_have_blocks_and_snippets_to_run() -> None:
    assert len(BLOCKS) >= 50, len(BLOCKS)
    assert len(SNIPPETS) >= 5, [b.where for b in SNIPPETS]


def test_every_python_block_runs_or_says_what_it_is() -> None:
    unmarked = [b.where for b in BLOCKS if b.language in PYTHON and b.marker is None]
    assert not unmarked, (
        f"python blocks with no marker: {unmarked}. Make each run as written and put "
        "<!-- mpx-doc-test: N --> (N ranks) on the line before it, or mark it "
        "<!-- mpx-doc-fragment: examples/NAME.py --> (a part of a tested example); see "
        "tests/test_docs.py"
    )
    untagged = [
        b.where for b in BLOCKS if b.language == "" and re.match(r"(import|from) \w", b.code)
    ]
    assert not untagged, f"untagged blocks of Python: {untagged}: tag them ```python and mark them"
    misplaced = [
        b.where
        for b in BLOCKS
        if b.marker
        and b.marker[0] == "test"
        and (b.language not in PYTHON or not b.marker[1].isdigit() or int(b.marker[1]) < 1)
    ]
    assert not misplaced, f"mpx-doc-test marks a python block, with a rank count >= 1: {misplaced}"
    foreign = [
        b.where
        for b in BLOCKS
        if b.marker and b.marker[0] == "other-project" and "docs/migration/" not in b.where
    ]
    assert not foreign, f"another project's code belongs in the migration guides only: {foreign}"


@pytest.mark.parametrize("block", FRAGMENTS, ids=[b.where for b in FRAGMENTS])
def test_a_fragment_is_part_of_a_tested_example(block: Block) -> None:
    assert block.marker is not None
    name = block.marker[1]
    example = ROOT / name
    assert name.startswith("examples/"), f"{block.where}: {name} is not under examples/"
    assert example.is_file(), f"{block.where}: {name} does not exist"
    runners = [t for t in TEST_FILES if example.name in t.read_text()]
    assert runners, f"{block.where}: no test runs {name} (no test file names {example.name})"
    lines = _code_lines(example.read_text())
    at = 0
    for wanted in _code_lines(block.code):
        try:
            at = lines.index(wanted, at) + 1
        except ValueError:
            pytest.fail(
                f"{block.where}: the line {wanted!r} is not in {name} (after the lines "
                "before it): make the page show the example's code"
            )


def test_the_paths_commands_name_exist() -> None:
    missing = [
        f"{b.where}: {path}"
        for b in BLOCKS
        if b.language in SHELL
        for path in REPO_PATH.findall(b.code)
        if not (ROOT / path.rstrip(".")).exists()
    ]
    assert not missing, f"commands name paths that do not exist: {missing}"


@pytest.mark.parametrize("block", SNIPPETS, ids=[b.where for b in SNIPPETS])
def test_snippet_runs(block: Block, tmp_path: Path, user_environment: dict[str, str]) -> None:
    assert block.marker is not None
    script = tmp_path / "snippet.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [MPXRUN, "-n", block.marker[1], "--timeout", "240", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=user_environment,
    )
    assert proc.returncode == 0, (
        f"{block.where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    )
