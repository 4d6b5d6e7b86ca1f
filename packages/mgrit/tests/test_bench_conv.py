"""benchmarks/bench_mgrit_conv.py in its ``--smoke`` configuration, and its model table.

The smoke run (16 convolutional steps, 4 channels, 8 x 8 images, one rank under
``mpxrun -n 1``) takes seconds; it must print the measured table (one row, every
column a number where one belongs), the model's predictions at 16 to 1024 ranks,
and LayerParallel's agreement with the serial network.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_mgrit_conv.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_mgrit_conv", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look the module up by name
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


def _table(lines: list[str], header: str) -> list[list[str]]:
    """The cells of the rows of the markdown table under ``header``."""
    start = lines.index(header)
    assert lines[start + 1].startswith("|---")
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("*") for cell in line.strip("|").split("|")])
    width = header.count("|") - 1
    assert all(len(row) == width for row in rows), rows
    return rows


@pytest.mark.timeout(200)
def test_the_smoke_run_prints_both_tables_and_agrees_with_serial() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke"],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("## mpx-mgrit: a convolutional ResNet step")
    measured = _table(lines, BENCH.MEASURED_HEADER)
    assert [row[:2] for row in measured] == [["16", "1"]]
    (row,) = measured
    lp, serial, ratio, model = (float(cell) for cell in row[2:6])
    assert lp > 0
    assert serial > 0
    assert ratio > 0
    assert model > 0
    assert row[6].endswith("%")
    assert all(float(us) > 0 for us in row[7].split("/"))  # the four kinds' costs
    assert [int(n) for n in row[8].split("/")][3] == 16  # one gradient per step
    assert float(row[9]) <= BENCH.OUTPUT_TOL
    assert float(row[10]) <= BENCH.GRADIENT_TOL
    predicted = _table(lines, BENCH.PREDICTED_HEADER)
    assert [(int(row[0]), row[1]) for row in predicted] == [
        (p, layout) for p in BENCH.PREDICT_RANKS for layout in BENCH.LAYOUTS
    ]
    for row in predicted:
        t, serial_t, speedup, best, t_best, speedup_best = (float(c) for c in row[2:])
        assert t > 0
        assert serial_t > 0
        assert speedup > 0
        assert int(best) in BENCH.LEVEL_CHOICES
        assert t_best <= t
        assert speedup_best >= speedup
    assert any("Correctness:" in line and "**ok**" in line for line in lines)


def test_the_model_rows_price_unbatched_steps_alike() -> None:
    """A row and a single-row call cost the same; a step five times a layer's forward
    (the serial network's, measured) is predicted faster at 16 ranks and more."""
    layer = {"forward": 1e-3, "adjoint": 3e-3, "linearize": 1.5e-3, "gradient": 3e-3}
    costs = BENCH.model_costs(layer, message=1e-4, cores=float(1 << 30))
    assert costs.row == costs.single == layer
    rows = [row.strip("|").split("|") for row in BENCH.prediction_rows(layer, 1e-4, 5e-3)]
    assert len(rows) == len(BENCH.PREDICT_RANKS) * len(BENCH.LAYOUTS)
    for row in rows:
        t, serial, speedup = float(row[2]), float(row[3]), float(row[4].strip(" *"))
        assert serial == pytest.approx(BENCH.PREDICT_STEPS * 5.0)  # ms
        assert speedup == pytest.approx(serial / t, rel=0.01)
        assert speedup > 1
    assert BENCH.predicted(1000, 3, 1, costs, "fine") is None  # not a multiple of 16
