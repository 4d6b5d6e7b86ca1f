"""The main job's plot (examples/train_digits.py): loss, accuracy, MGRIT residuals.

* :class:`PanelLabels`, :func:`panel_labels`: what each mode's panels measure
  (the digits' classifier, or ``--mode gpt``'s character-level language model).
* :func:`plot`: the curves of a :class:`digits_data.History` to a PNG
  (matplotlib, Agg backend); a third panel when the run recorded MGRIT residuals.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import digits_data
else:  # run as scripts: this folder is on sys.path
    import digits_data

__all__ = ["DIGITS_LABELS", "GPT_LABELS", "PanelLabels", "panel_labels", "plot"]


@dataclass(frozen=True)
class PanelLabels:
    """What the loss and accuracy panels of a mode's plot measure."""

    xlabel: str
    loss: str
    loss_title: str
    accuracy: str
    accuracy_title: str
    # The digits' loss falls by decades; a language model's by a fraction of its first value.
    loss_scale: str = "log"


DIGITS_LABELS = PanelLabels(
    xlabel="epoch",
    loss="training loss (cross-entropy)",
    loss_title="training loss",
    accuracy="test accuracy (%)",
    accuracy_title="digits' test set",
)
# --mode gpt trains a character-level language model: no digits, no classes to count.
GPT_LABELS = PanelLabels(
    xlabel=f"epoch ({digits_data.GPT_STEPS_PER_EPOCH} steps)",
    loss="training loss (nats/char)",
    loss_title="next-character cross-entropy",
    accuracy="next-character accuracy (%)",
    accuracy_title="held-out source text",
    loss_scale="linear",
)


def panel_labels(mode: str) -> PanelLabels:
    return GPT_LABELS if mode == "gpt" else DIGITS_LABELS


def plot(
    history: digits_data.History, path: str, title: str, labels: PanelLabels = DIGITS_LABELS
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if history.residuals and any(history.residuals) else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.5))
    epochs = range(1, len(history.loss) + 1)
    axes[0].plot(epochs, history.loss, marker="o")
    axes[0].set(xlabel=labels.xlabel, ylabel=labels.loss, title=labels.loss_title)
    axes[0].set_yscale(labels.loss_scale)
    axes[1].plot(epochs, [100 * a for a in history.accuracy], marker="o", color="tab:green")
    axes[1].set(xlabel=labels.xlabel, ylabel=labels.accuracy, title=labels.accuracy_title)
    from matplotlib.ticker import MaxNLocator

    for ax in axes[:2]:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs are whole
    if panels == 3:
        # One curve per epoch (the last batch's forward solve): a family, so coloured by
        # epoch with a colour bar instead of ~20 legend entries; iterations are integers.
        from matplotlib.cm import ScalarMappable
        from matplotlib.colors import Normalize

        cmap = plt.get_cmap("viridis")
        norm = Normalize(vmin=1, vmax=max(2, len(history.residuals)))
        for i, res in enumerate(history.residuals):
            if res:
                axes[2].semilogy(
                    range(1, len(res) + 1), res, marker="o", color=cmap(norm(i + 1)), alpha=0.8
                )
        axes[2].set_xlim(0.5, max(len(res) for res in history.residuals) + 0.5)
        axes[2].xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        axes[2].set(
            xlabel="MGRIT iteration",
            ylabel="forward C-point residual",
            title="last batch of each epoch",
        )
        bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=axes[2], pad=0.02)
        bar.set_label("epoch")
        bar.locator = MaxNLocator(integer=True)
        bar.update_ticks()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
