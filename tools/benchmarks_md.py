"""BENCHMARKS.md's layout: the current figures, each script's last full table, the history.

BENCHMARKS.md has one section of current figures a package (``## mpx-launch`` ... and
``## GPU window``), each a table with the columns of ``SUMMARY_HEADER`` (sub-tables under
``###`` headings allowed, as ``### live recovery``), then ``## Full tables``: the last full
output of each benchmark script between ``<!-- bench:NAME begin -->`` and
``<!-- bench:NAME end -->`` (NAME = ``<package>/<script stem>``).

``nox -s bench`` calls :func:`update`: it replaces the script's block, moves the block it
replaced to the end of docs/benchmarks-history.md, and returns the current-figure rows
whose command runs that script (they are edited by hand: a script's table is not a row).
:func:`problems` checks the layout; tests/test_benchmarks_md.py runs it on BENCHMARKS.md.
"""

from __future__ import annotations

import datetime
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "FULL_TABLES",
    "MACHINES",
    "SECTIONS",
    "SUMMARY_HEADER",
    "Row",
    "problems",
    "record_replaced",
    "replace_block",
    "rows",
    "script_of",
    "update",
]

# The packages' sections, in this order, each exactly once.
SECTIONS = (
    "mpx-launch",
    "mpx-collectives",
    "mpx-quantize",
    "mpx-mgrit",
    "mpx-pipeline",
    "mpx-dataparallel",
    "GPU window",
)
SUMMARY_HEADER = "| what | figure (range) | peer | command | machine, date |"
FULL_TABLES = "Full tables"
# The machines the intro describes; a row names one of them.
MACHINES = ("2-core VM", "H200 window")
HISTORY = Path("docs") / "benchmarks-history.md"

_HEADING = re.compile(r"^(#{1,6}) (.*)$")
_MARKER = re.compile(r"^<!-- bench:(\S+) (begin|end) -->$")
_DATE = re.compile(r"\b(\d{4})-(\d{2})-(\d{2})\b")
_CODE = re.compile(r"`([^`]+)`")
_SCRIPT_SUFFIXES = (".py", ".sh")


@dataclass(frozen=True)
class Row:
    """One row of a current-figures table."""

    line: int  # 1-based, in BENCHMARKS.md
    section: str  # the ``##`` heading it is under
    cells: tuple[str, ...]


def _cells(line: str) -> tuple[str, ...]:
    # A cell may hold `a | b` in code: split only on pipes outside backticks.
    cells, current, in_code = [], "", False
    for char in line.strip()[1:-1] if line.strip().endswith("|") else line.strip()[1:]:
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
    cells.append(current.strip())
    return tuple(cells)


def rows(text: str) -> list[Row]:
    """The rows of every current-figures table (``SUMMARY_HEADER``), before ``## Full tables``."""
    found: list[Row] = []
    section = ""
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        heading = _HEADING.match(lines[i])
        if heading and len(heading[1]) == 2:
            section = heading[2].strip()
            if section == FULL_TABLES:
                break
        if lines[i].strip() == SUMMARY_HEADER:
            i += 2  # the header and its |---| line
            while i < len(lines) and lines[i].startswith("|"):
                found.append(Row(i + 1, section, _cells(lines[i])))
                i += 1
            continue
        i += 1
    return found


def script_of(command: str) -> str | None:
    """The script a row's command runs: the first word of its first code span that ends in
    .py or .sh (``MPX_X=1 python path/to/bench.py --flag`` -> ``path/to/bench.py``)."""
    code = _CODE.search(command)
    if code is None:
        return None
    try:
        words = shlex.split(code[1])
    except ValueError:
        words = code[1].split()
    return next((w for w in words if w.endswith(_SCRIPT_SUFFIXES)), None)


def _row_problems(row: Row, root: Path) -> list[str]:
    where = f"line {row.line} ({row.section})"
    if len(row.cells) != 5:
        return [f"{where}: {len(row.cells)} cells, the table has 5: {' | '.join(row.cells)}"]
    what, figure, _peer, command, machine_date = row.cells
    found = []
    if not what or not figure:
        found.append(f"{where}: no 'what' or no figure")
    script = script_of(command)
    if script is None:
        found.append(f"{where}: the command {command!r} names no script (`python path/x.py ...`)")
    elif not (root / script).is_file():
        found.append(f"{where}: the command's script {script} is not a file of the repository")
    date = _DATE.search(machine_date)
    if date is None:
        found.append(f"{where}: no date (YYYY-MM-DD) in {machine_date!r}")
    else:
        try:
            datetime.date(int(date[1]), int(date[2]), int(date[3]))
        except ValueError:
            found.append(f"{where}: {date[0]} is not a date")
    if not any(machine in machine_date for machine in MACHINES):
        found.append(f"{where}: no machine ({' or '.join(MACHINES)}) in {machine_date!r}")
    return found


def _block_problems(lines: list[str], root: Path, full_tables_at: int | None) -> list[str]:
    found, open_name, seen = [], None, set()
    for number, line in enumerate(lines, 1):
        marker = _MARKER.match(line.strip())
        if marker is None:
            continue
        name, kind = marker[1], marker[2]
        if kind == "begin":
            if open_name is not None:
                found.append(f"line {number}: {name}'s block begins inside {open_name}'s")
            if name in seen:
                found.append(f"line {number}: a second block for {name}")
            if full_tables_at is None or number < full_tables_at:
                found.append(f"line {number}: {name}'s block is not under '## {FULL_TABLES}'")
            package, _, stem = name.partition("/")
            if not (root / "packages" / package / "benchmarks" / f"{stem}.py").is_file():
                found.append(f"line {number}: no script packages/{package}/benchmarks/{stem}.py")
            open_name = name
            seen.add(name)
        elif open_name != name:
            found.append(f"line {number}: {name}'s block ends, but the open one is {open_name}")
        else:
            open_name = None
    if open_name is not None:
        found.append(f"{open_name}'s block never ends")
    return found


def problems(text: str, root: Path) -> list[str]:
    """Everything wrong with the layout of BENCHMARKS.md's ``text`` (empty: all is well).

    Each package's section exactly once, in ``SECTIONS``' order, with a current-figures
    table; every row: five cells, a command running a script of the repository at
    ``root``, a date and a machine; the full tables' blocks balanced, once each, under
    ``## Full tables``, each naming an existing benchmark script.
    """
    lines = text.splitlines()
    headings = []  # (line number, text) of the ## headings
    for number, line in enumerate(lines, 1):
        heading = _HEADING.match(line)
        if heading and len(heading[1]) == 2:
            headings.append((number, heading[2].strip()))
    names = [name for _, name in headings]
    found = []
    for section in SECTIONS:
        if names.count(section) != 1:
            found.append(f"'## {section}' appears {names.count(section)} times, not once")
    order = [name for name in names if name in SECTIONS]
    if not found and order != list(SECTIONS):
        found.append(f"the sections are not in the order {SECTIONS}: {order}")
    full_tables_at = next((n for n, name in headings if name == FULL_TABLES), None)
    if full_tables_at is None:
        found.append(f"no '## {FULL_TABLES}' section")
    table_rows = rows(text)
    for section in SECTIONS:
        if names.count(section) == 1 and not any(r.section == section for r in table_rows):
            found.append(f"'## {section}' has no table headed {SUMMARY_HEADER}")
    for row in table_rows:
        if row.section not in SECTIONS:
            found.append(f"line {row.line}: a current-figures row outside the packages' sections")
        found.extend(_row_problems(row, root))
    found.extend(_block_problems(lines, root, full_tables_at))
    return found


def _demote(markdown: str) -> str:
    return re.sub(r"^(#{1,5}) ", r"#\1 ", markdown, flags=re.MULTILINE)


def _block_pattern(name: str) -> re.Pattern[str]:
    begin, end = f"<!-- bench:{name} begin -->", f"<!-- bench:{name} end -->"
    return re.compile(re.escape(begin) + r"\n(.*?)\n?" + re.escape(end), re.DOTALL)


def replace_block(
    text: str, name: str, table: str, measured: datetime.date
) -> tuple[str, str | None]:
    """``text`` with NAME's block holding ``table`` (added at the end if it had none), and the
    content of the block it replaced (None if there was none)."""
    # The script's headings one level down: its table sits under '## Full tables'.
    demoted = _demote(table.strip())
    content = f"Measured {measured.isoformat()} (`nox -s bench`).\n\n{demoted}"
    block = f"<!-- bench:{name} begin -->\n{content}\n<!-- bench:{name} end -->"
    found = _block_pattern(name).search(text)
    if found is None:
        return f"{text.rstrip()}\n\n{block}\n", None
    return text[: found.start()] + block + text[found.end() :], found[1]


def record_replaced(history: str, name: str, old: str, replaced_on: datetime.date) -> str:
    """The history page with a replaced block added at its end, its headings one level
    down (under a heading of its own)."""
    demoted = _demote(old.strip())
    heading = f"## {name}: the full table replaced on {replaced_on.isoformat()}"
    return f"{history.rstrip()}\n\n{heading}\n\n{demoted}\n"


def update(root: Path, name: str, table: str, today: datetime.date) -> list[Row]:
    """``nox -s bench``'s step: NAME's block in root/BENCHMARKS.md replaced by ``table``,
    the replaced block moved to the history page; returns the current-figures rows whose
    command runs NAME's script (to be checked by hand against the new table)."""
    path = root / "BENCHMARKS.md"
    text, old = replace_block(path.read_text(), name, table, today)
    path.write_text(text)
    if old is not None and old.strip():
        history = root / HISTORY
        history.write_text(record_replaced(history.read_text(), name, old, today))
    package, _, stem = name.partition("/")
    script = f"packages/{package}/benchmarks/{stem}.py"
    return [row for row in rows(text) if len(row.cells) == 5 and script_of(row.cells[3]) == script]
