"""Every runnable snippet of the docs and package READMEs runs, under mpxrun.

A fenced ``python`` block preceded by the line ``<!-- mpx-doc-test: N -->``
is extracted and run as a script with ``mpxrun -n N``; it must exit 0. The
snippets assert their own results (equal weights across ranks, residuals...),
so a page that drifts from the code fails here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"
MARK = re.compile(r"<!-- mpx-doc-test: (\d+) -->\s*\n```python\n(.*?)```", re.DOTALL)
PAGES = sorted([*ROOT.glob("docs/**/*.md"), ROOT / "README.md", *ROOT.glob("packages/*/README.md")])


def _snippets() -> list[tuple[str, int, str]]:
    found = []
    for page in PAGES:
        for index, match in enumerate(MARK.finditer(page.read_text())):
            found.append((f"{page.relative_to(ROOT)}#{index}", int(match[1]), match[2]))
    return found


SNIPPETS = _snippets()


def test_there_are_snippets_to_run() -> None:
    assert len(SNIPPETS) >= 5, [name for name, _, _ in SNIPPETS]


@pytest.mark.parametrize(("name", "ranks", "code"), SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_snippet_runs(
    name: str, ranks: int, code: str, tmp_path: Path, user_environment: dict[str, str]
) -> None:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    proc = subprocess.run(
        [MPXRUN, "-n", str(ranks), "--timeout", "240", "--", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=tmp_path,
        env=user_environment,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
