"""docs/settings.md shows the settings table as the installed packages declare it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from mpx.launch.settings import all_settings, markdown_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "settings.md"


def test_docs_table_is_the_declared_table() -> None:
    text = DOC.read_text()
    match = re.search(r"<!-- settings table begin -->\n(.*)<!-- settings table end -->", text, re.S)
    assert match is not None, f"{DOC} lost its table markers"
    # In a fresh interpreter: this process may have imported modules that
    # declare settings of their own (examples/train_digits.py declares the
    # demo's), which are not part of any installed package's table.
    installed = subprocess.run(
        [sys.executable, "-c", "from mpx.launch.settings import markdown_table as t; print(t())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout[:-1]
    assert match.group(1) == installed, (
        "docs/settings.md is out of date: regenerate its table with `mpxrun --settings`"
    )


def test_every_package_declares_its_variables() -> None:
    markdown_table()  # loads every installed package's declarations
    packages = {s.package for s in all_settings()}
    assert {"launch", "collectives", "quantize"} <= packages
    names = [s.name for s in all_settings()]
    assert len(names) == len(set(names))
