"""BENCHMARKS.md keeps its layout: one current table a package, every row runnable and dated.

The checks are tools/benchmarks_md.py's (``nox -s bench`` writes through the same module);
each kind of breakage is also fed to them here, so a check that could not fail would show.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "benchmarks_md", ROOT / "tools" / "benchmarks_md.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


LAYOUT = _load()
TEXT = (ROOT / "BENCHMARKS.md").read_text()
LAUNCH_COMMAND = "`python packages/launch/benchmarks/bench_startup.py`"


def test_benchmarks_md_has_its_layout() -> None:
    assert LAYOUT.problems(TEXT, ROOT) == []


def test_every_package_has_one_current_section_with_rows() -> None:
    sections = [row.section for row in LAYOUT.rows(TEXT)]
    for section in LAYOUT.SECTIONS:
        assert sections.count(section) >= 1, section
    assert "mpx-dataparallel" in [line[3:] for line in TEXT.splitlines() if line.startswith("## ")]
    # Live recovery's rows have a table of their own, under mpx-dataparallel.
    assert "\n### live recovery\n" in TEXT.split("\n## mpx-dataparallel\n")[1].split("\n## ")[0]


def test_every_row_runs_an_existing_script_and_has_a_date() -> None:
    table_rows = LAYOUT.rows(TEXT)
    assert len(table_rows) >= 7
    for row in table_rows:
        script = LAYOUT.script_of(row.cells[3])
        assert script is not None, row
        assert (ROOT / script).is_file(), row
        assert any(char.isdigit() for char in row.cells[4]), row


@pytest.mark.parametrize(
    ("command", "script"),
    [
        ("`python packages/x/benchmarks/bench_a.py --ranks 2`", "packages/x/benchmarks/bench_a.py"),
        ("`MPX_BENCH_MAX_BYTES=16M python a/b.py`", "a/b.py"),
        ("`mpxrun -n 2 -- python b.py [--step]` and `python c.py`", "b.py"),
        ("`bash tools/slurm_cluster.sh start`", "tools/slurm_cluster.sh"),
        ("`nox -s bench`", None),
        ("python a.py (no code span)", None),
    ],
)
def test_script_of_reads_the_script_out_of_a_command(command: str, script: str | None) -> None:
    assert LAYOUT.script_of(command) == script


def _only_problem(text: str, expected: str) -> None:
    found = LAYOUT.problems(text, ROOT)
    assert found, f"no problem found, expected one containing {expected!r}"
    assert any(expected in problem for problem in found), found


def test_a_second_section_for_a_package_is_found() -> None:
    extra = f"## mpx-launch\n\n{LAYOUT.SUMMARY_HEADER}\n|---|---|---|---|---|\n"
    extra += f"| x | 1 s | - | {LAUNCH_COMMAND} | 2-core VM, 2026-12-07 |\n\n"
    _only_problem(TEXT.replace("## mpx-quantize\n", extra + "## mpx-quantize\n"), "2 times")


def test_a_missing_section_is_found() -> None:
    _only_problem(TEXT.replace("## mpx-mgrit\n", "## mgrit\n"), "'## mpx-mgrit' appears 0 times")


def test_a_command_naming_no_file_is_found() -> None:
    broken = TEXT.replace(LAUNCH_COMMAND, "`python packages/launch/benchmarks/bench_gone.py`", 1)
    _only_problem(broken, "bench_gone.py is not a file")
    _only_problem(TEXT.replace(LAUNCH_COMMAND, "`mpxrun -n 2`", 1), "names no script")


def test_a_row_without_a_date_or_machine_is_found() -> None:
    # The first row's machine-and-date cell, whichever figures BENCHMARKS.md holds now.
    cell = re.search(r"\| (2-core VM, [^|]*?), (\d{4})-(\d{2}-\d{2}) \|\n", TEXT)
    assert cell is not None
    machine, year, day = cell.groups()
    _only_problem(TEXT.replace(cell[0], f"| {machine} |\n", 1), "no date")
    _only_problem(TEXT.replace(cell[0], f"| {year}-{day} |\n", 1), "no machine")
    month_13 = f"| {machine}, {year}-13-{day[3:]} |\n"
    _only_problem(TEXT.replace(cell[0], month_13, 1), "is not a date")


def test_a_row_with_a_cell_too_many_is_found() -> None:
    _only_problem(TEXT.replace(f"| {LAUNCH_COMMAND} |", f"| {LAUNCH_COMMAND} | x |", 1), "6 cells")


def test_unbalanced_or_misplaced_full_tables_are_found() -> None:
    last_end = "<!-- bench:quantize/bench_quantize end -->"
    _only_problem(TEXT.replace(last_end, "", 1), "quantize/bench_quantize's block never ends")
    # A block begun inside another: what once hid mgrit's sections in pipeline's block.
    _only_problem(TEXT.replace("<!-- bench:launch/bench_startup end -->", "", 1), "inside")
    moved = "<!-- bench:launch/bench_gone begin -->\nx\n<!-- bench:launch/bench_gone end -->\n"
    _only_problem(TEXT.replace("## mpx-collectives\n", moved + "## mpx-collectives\n"), "not under")
    _only_problem(TEXT + "\n" + moved, "no script packages/launch/benchmarks/bench_gone.py")


def test_update_replaces_a_table_and_moves_the_old_one_to_the_history(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "BENCHMARKS.md").write_text(TEXT)
    history = ROOT / "docs" / "benchmarks-history.md"
    (tmp_path / "docs" / "benchmarks-history.md").write_text(history.read_text())
    table = (
        "## mpx-launch: mpxrun vs the bare launcher\n\n| what | mpxrun |\n|---|---|\n| x | 9 s |\n"
    )
    day = datetime.date(2031, 1, 2)

    citing = LAYOUT.update(tmp_path, "launch/bench_startup", table, day)

    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert LAYOUT.problems(text, ROOT) == []
    assert (
        "Measured 2031-01-02 (`nox -s bench`).\n\n### mpx-launch: mpxrun vs the bare launcher"
        in text
    )
    assert "| x | 9 s |" in text
    # Everything outside the block is as it was; the block is the only change.
    before, _, after = TEXT.partition("<!-- bench:launch/bench_startup begin -->")
    assert text.startswith(before)
    assert text.endswith(after.partition("<!-- bench:launch/bench_startup end -->")[2])
    moved = (tmp_path / "docs" / "benchmarks-history.md").read_text()
    assert moved.startswith(history.read_text().rstrip())
    assert "## launch/bench_startup: the full table replaced on 2031-01-02" in moved
    assert "#### mpx-launch: mpxrun vs the bare launcher" in moved  # under its heading
    assert [row.cells[3] for row in citing] == [LAUNCH_COMMAND] * len(citing)
    assert len(citing) == 2

    # A script with no table yet gets one at the end, under '## Full tables'.
    LAYOUT.update(tmp_path, "pipeline/bench_conv1d", "conv1d's table", day)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert text.rstrip().endswith("conv1d's table\n<!-- bench:pipeline/bench_conv1d end -->")
    assert LAYOUT.problems(text, ROOT) == []
