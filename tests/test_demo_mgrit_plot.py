"""The mgrit demo's plot (``nox -s demo -- --mode mgrit``): its residual panel is readable.

One curve per epoch is a family: it needs a colour bar (or legend) that says
which curve is which epoch, and the MGRIT iterations on its x axis are
integers, so no fractional ticks.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _demo() -> ModuleType:
    # Loaded once per process: it declares its MPX_DEMO_* settings, and a second
    # declaration of the same name is an error (the other demo plot tests load it too).
    if "train_digits" in sys.modules:
        return sys.modules["train_digits"]
    spec = importlib.util.spec_from_file_location(
        "train_digits", ROOT / "examples" / "train_digits.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_residual_panel_has_integer_iterations_and_an_epoch_colour_bar(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    demo = _demo()
    epochs = 20
    history = demo.History(
        loss=[1.0 / (e + 1) for e in range(epochs)],
        accuracy=[0.9] * epochs,
        seconds=[0.1] * epochs,
        residuals=[[5e-3 * (1 + e / 40), 2e-5] for e in range(epochs)],  # 2 iterations each
    )
    path = tmp_path / "digits_mgrit.png"
    plt.close("all")
    demo.plot(history, str(path), "mgrit")
    assert path.stat().st_size > 10_000
    fig = plt.gcf()
    panel = fig.axes[2]
    assert len(panel.get_lines()) == epochs
    low, high = panel.get_xlim()
    ticks = [t for t in panel.get_xticks() if low <= t <= high]
    assert ticks == [1.0, 2.0], ticks  # integer ticks only, for 2 iterations
    # The family is labelled: a colour bar named "epoch", with integer ticks over 1..20.
    bars = [ax for ax in fig.axes[3:] if ax.get_ylabel() == "epoch"]
    assert len(bars) == 1, [ax.get_ylabel() for ax in fig.axes]
    low, high = bars[0].get_ylim()
    assert (low, high) == (1.0, float(epochs))
    bar_ticks = [t for t in bars[0].get_yticks() if low <= t <= high]
    assert len(bar_ticks) >= 2
    assert all(float(t).is_integer() for t in bar_ticks), bar_ticks
    # Early and late epochs are told apart by colour.
    first, last = panel.get_lines()[0], panel.get_lines()[-1]
    assert first.get_color() != last.get_color()
    plt.close(fig)
