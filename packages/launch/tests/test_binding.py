"""--bind core|numa where the launcher cannot bind: the rank supervisor pins its program."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mpx.launch.rank import binding, cpus_for

MPXRUN = os.path.join(os.path.dirname(sys.executable), "mpxrun")


def test_cpu_lists_in_sysfs_form() -> None:
    assert binding._parse_cpu_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert binding._parse_cpu_list("") == set()


def test_local_ranks_take_cores_round_robin_with_all_their_threads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Two cores of two hardware threads each: {0, 2} and {1, 3}.
    siblings = {0: {0, 2}, 2: {0, 2}, 1: {1, 3}, 3: {1, 3}}

    def read(path: str) -> set[int] | None:
        match = re.search(r"/cpu(\d+)/", path)
        assert match is not None
        return siblings[int(match.group(1))]

    monkeypatch.setattr(binding, "_read_cpu_list", read)
    usable = {0, 1, 2, 3}
    assert [cpus_for("core", r, usable) for r in range(3)] == [{0, 2}, {1, 3}, {0, 2}]
    # A CPU outside the affinity mask is never handed out.
    assert cpus_for("core", 0, {0, 1}) == {0}


def test_numa_falls_back_to_every_usable_cpu_without_topology(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(binding, "_SYS_NODE", "/nonexistent")
    assert cpus_for("numa", 5, {0, 1}) == {0, 1}
    with pytest.raises(ValueError, match="'socket'"):
        cpus_for("socket", 0, {0})


PROGRAM = textwrap.dedent(
    """
    import os
    from mpx.launch import environment
    cpus = sorted(os.sched_getaffinity(0))
    os.write(1, f"rank {environment().rank} cpus {cpus}\\n".encode())
    """
)


@pytest.mark.parametrize("nprocs", [1, 2, 3])
def test_bind_core_pins_each_rank_to_its_core(tmp_path: Path, nprocs: int) -> None:
    script = tmp_path / "prog.py"
    script.write_text(PROGRAM)
    proc = subprocess.run(
        [MPXRUN, "-n", str(nprocs), "--bind", "core", "--timeout", "120", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    expected = [f"rank {r} cpus {sorted(cpus_for('core', r))}" for r in range(nprocs)]
    assert sorted(ln for ln in proc.stdout.splitlines() if ln.startswith("rank")) == expected
