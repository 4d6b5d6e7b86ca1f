"""Lightning's Trainer on mpx: DDP over the ``mpx`` backend, ranks started by mpxrun.

TorchMPI's users trained through its ``AllReduceSGDEngine``; the engine PyTorch
users reach for today is Lightning's ``Trainer``. Lightning's own
``MPIEnvironment`` reads rank and size from MPI, and its ``DDPStrategy`` takes
the process group backend by name, so nothing of mpx appears below but that
name (``import torch`` registers ``mpx``, see mpx-collectives)::

    mpxrun -n 2 -- python examples/lightning_digits.py --backend mpx
    mpxrun -n 2 -- python examples/lightning_digits.py --backend gloo   # the same numbers

Rank 0 prints one line per epoch: the mean training loss and a checksum of the
weights, which equal the gloo run's.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from lightning.fabric.plugins.environments.mpi import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy
from sklearn.datasets import load_digits
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DigitsClassifier(L.LightningModule):
    """The 64-32-10 network of the other digits examples."""

    def __init__(self, lr: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
        self.lr = lr
        self.epoch_losses: list[torch.Tensor] = []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.epoch_losses.append(loss.detach())
        return loss

    def on_train_epoch_end(self) -> None:
        # The mean over every rank's batches: the same number on every backend.
        mean = self.trainer.strategy.reduce(torch.stack(self.epoch_losses).mean(), reduce_op="mean")
        self.epoch_losses.clear()
        weights = sum(float(p.detach().double().sum()) for p in self.net.parameters())
        if self.global_rank == 0:
            backend = torch.distributed.get_backend()
            line = (
                f"epoch {self.current_epoch} loss {mean.item():.9g} weights {weights:.17g} "
                f"(backend {backend}, {self.trainer.world_size} ranks)\n"
            )
            os.write(1, line.encode())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def digits() -> TensorDataset:
    x, y = load_digits(return_X_y=True)
    return TensorDataset(torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="mpx", help="mpx, cgx or gloo")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    environment = MPIEnvironment()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=max(1, environment.world_size() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))),
        strategy=DDPStrategy(process_group_backend=args.backend, cluster_environment=environment),
        max_epochs=args.epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # Lightning adds a DistributedSampler: each rank trains on its share.
    loader = DataLoader(digits(), batch_size=args.batch_size, shuffle=True)
    trainer.fit(DigitsClassifier(lr=0.05), loader)


if __name__ == "__main__":
    main()
