"""The main job's data, network and run record (examples/train_digits.py).

* :func:`load`: scikit-learn's digits, split train 1437 / test 360, the same
  split on every rank (seeded); :func:`batches`: an epoch's global batches, the
  same on every rank (a seeded shuffle); :func:`accuracy_of`: on the test set.
* :func:`mlp`: the network every digits mode trains (dp, ddp, pipeline, 2d).
* :class:`History`: what the run records per epoch (plotted, saved, checkpointed).
* :data:`RESUMABLE`: what the mode built, for --checkpoint-dir.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

__all__ = [
    "GPT_STEPS_PER_EPOCH",
    "RESUMABLE",
    "Data",
    "History",
    "Resumable",
    "accuracy_of",
    "batches",
    "load",
    "mlp",
]

GPT_STEPS_PER_EPOCH = 10


@dataclass
class Data:
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


@dataclass
class History:
    loss: list[float] = field(default_factory=list)
    accuracy: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)
    residuals: list[list[float]] = field(default_factory=list)


@dataclass
class Resumable:
    """What a checkpoint of the run holds; ``sharded``: ranks hold different parts."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    sharded: bool


# Set by each mode for --checkpoint-dir (a mode that does not cannot checkpoint).
RESUMABLE: list[Resumable] = []


def load(seed: int) -> Data:
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32),
        digits.target,
        test_size=0.2,
        random_state=seed,
        stratify=digits.target,
    )
    return Data(
        torch.from_numpy(x_train),
        torch.from_numpy(y_train),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test),
    )


def mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64),
        nn.ReLU(), nn.Linear(64, 10),
    )  # fmt: skip


def batches(data: Data, epoch: int, batch_size: int) -> list[torch.Tensor]:
    """The epoch's global batches (the same on every rank: a seeded shuffle)."""
    order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(epoch))
    steps = len(order) // batch_size
    return [order[i * batch_size : (i + 1) * batch_size] for i in range(steps)]


def accuracy_of(predict: Callable[[torch.Tensor], torch.Tensor | None], data: Data) -> float:
    with torch.no_grad():
        out = predict(data.x_test)
    return float((out.argmax(1) == data.y_test).float().mean()) if out is not None else -1.0
