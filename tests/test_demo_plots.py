"""The demo's plots say what each mode measures, readably (issue 33).

``--mode gpt`` trains a character-level language model on the standard
library's source: its panels are the next-character cross-entropy in nats per
character and the next-character accuracy on held-out text, not the digits'
"training loss" and "test accuracy". ``--mode mgrit``'s residual panel, one
curve per epoch, needs a colour bar (or legend) that says which curve is which
epoch, and its MGRIT iterations are integers, so no fractional ticks.
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


def _panels(tmp_path: Path, mode: str) -> list[tuple[str, str, str, str]]:
    """(x label, y label, title, y scale) of the plot's panels for ``mode``."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    demo = _demo()
    history = demo.History(loss=[3.4, 2.9, 2.6], accuracy=[0.2, 0.35, 0.41], seconds=[1.0] * 3)
    path = tmp_path / f"{mode}.png"
    plt.close("all")
    demo.plot(history, str(path), f"mpx: {mode}", demo.panel_labels(mode))
    assert path.stat().st_size > 10_000
    fig = plt.gcf()
    found = [(ax.get_xlabel(), ax.get_ylabel(), ax.get_title(), ax.get_yscale()) for ax in fig.axes]
    for ax in fig.axes[:2]:  # epochs are whole: no ticks at 1.5, 2.5
        low, high = ax.get_xlim()
        ticks = [t for t in ax.get_xticks() if low <= t <= high]
        assert ticks == [1.0, 2.0, 3.0], ticks
    plt.close(fig)
    return found


def test_gpt_panels_name_the_language_model_measures(tmp_path: Path) -> None:
    (x0, loss, loss_title, scale), (x1, accuracy, accuracy_title, _) = _panels(tmp_path, "gpt")
    assert loss == "training loss (nats/char)"
    assert loss_title == "next-character cross-entropy"
    assert accuracy == "next-character accuracy (%)"
    assert accuracy_title == "held-out source text"
    assert x0 == x1 == "epoch (10 steps)"
    assert "test accuracy" not in accuracy
    assert scale == "linear"  # 3.4 to 2.4 nats/char: a log axis only labels 10^0


@pytest.mark.parametrize("mode", ["dp", "ddp", "pipeline", "2d"])
def test_digits_panels_keep_the_classifier_measures(tmp_path: Path, mode: str) -> None:
    (x0, loss, _, scale), (x1, accuracy, accuracy_title, _) = _panels(tmp_path, mode)
    assert loss == "training loss (cross-entropy)"
    assert accuracy == "test accuracy (%)"
    assert accuracy_title == "digits' test set"
    assert x0 == x1 == "epoch"
    assert scale == "log"  # the digits' loss falls by decades


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


def test_every_run_has_files_of_its_own() -> None:
    """Named by mode, schedule and bits (issue 43): ``--bits 0`` overwrote the 4-bit run's
    ``digits_dp.*``, and gpipe, 1f1b and async all wrote ``digits_pipeline.*``."""
    import argparse

    from mpx.pipeline import SCHEDULES

    demo = _demo()
    names: dict[str, tuple[str, str, int]] = {}
    for mode in demo.MODES:
        for schedule in SCHEDULES if mode in ("pipeline", "2d", "gpt") else ("1f1b",):
            for bits in (4, 2, 0) if mode == "dp" else (4,):
                args = argparse.Namespace(mode=mode, schedule=schedule, bits=bits)
                name, flags = demo._run_name(args)
                assert name not in names, (name, names[name], (mode, schedule, bits))
                names[name] = (mode, schedule, bits)
                assert f"--mode {mode}" in flags
    expected = {"digits_dp_4bit", "digits_dp_fp32", "digits_pipeline_1f1b", "digits_pipeline_zbv",
                "digits_2d_gpipe", "gpt_stdlib_async", "digits_mgrit", "digits_ddp"}  # fmt: skip
    assert expected <= set(names)
