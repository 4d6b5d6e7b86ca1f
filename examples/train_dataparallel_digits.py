"""A small residual CNN on scikit-learn's digits with mpx.dataparallel (FluxMPI's API).

Run with ``mpxrun -n 2 -- python examples/train_dataparallel_digits.py`` (1, 2 or 3
ranks). The steps are FluxMPI's: init, synchronize the model, shard the data,
wrap the optimizer, synchronize its state, log on rank 0::

    digits (1797 x 1x8x8) ──split──> train 1437 │ test 360
    DistributedDataContainer: rank r gets a contiguous shard of each epoch's shuffle
    per step: forward/backward; gradient buckets allreduced from hooks during backward
              -> identical Adam step on every rank

    model: conv3x3(1->32) ─ [ResBlock 32] ─ [ResBlock 32, stride 2] ─ pool ─ fc(10)
           ResBlock: x + BN(conv(ReLU(BN(conv(x)))))  (1x1 conv on the skip when strided)

Rank 0 prints one line per epoch and the final test accuracy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import mpx.dataparallel as dp
from mpx.collectives import allreduce


class ResBlock(nn.Module):
    """Two 3x3 convolutions with batch norm, added to the (projected) input."""

    def __init__(self, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(channels, channels, 3, stride, 1, bias=False),
            nn.BatchNorm2d(channels),
            nn.ReLU(),
            nn.Conv2d(channels, channels, 3, 1, 1, bias=False),
            nn.BatchNorm2d(channels),
        )
        self.skip = (
            nn.Identity()
            if stride == 1
            else nn.Sequential(nn.Conv2d(channels, channels, 1, stride, bias=False))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


def make_model(width: int = 32) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        ResBlock(width),
        ResBlock(width, stride=2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, 10),
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=60, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    comm = dp.init()  # 1. start (pins a GPU per local rank when there are GPUs)
    world = dp.world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} ranks")

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.images / 16.0).astype(np.float32)[:, None],
        digits.target,
        test_size=0.2,
        random_state=args.seed,
        stratify=digits.target,
    )
    train = dp.DistributedDataContainer(  # 3. this rank's shard (equal lengths: "pad")
        (torch.from_numpy(x_train), torch.from_numpy(y_train)), shuffle=True, seed=args.seed
    )
    loader = torch.utils.data.DataLoader(train, batch_size=args.batch_size // world)

    torch.manual_seed(args.seed + dp.rank())  # deliberately different: synchronize fixes it
    model = dp.synchronize(make_model())  # 2. root's weights and buffers everywhere
    optimizer = dp.DistributedOptimizer(  # 4. averaged gradients (overlapped where it pays)
        torch.optim.Adam(model.parameters(), lr=args.lr), model
    )
    dp.synchronize(optimizer)  # 5. optimizer state (trivial here: a fresh Adam)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, args.epochs)
    loss_fn = nn.CrossEntropyLoss()

    start = time.perf_counter()
    for epoch in range(args.epochs):
        train.set_epoch(epoch)
        model.train()
        total = torch.zeros(3, dtype=torch.float64)
        for x, y in loader:
            optimizer.zero_grad()
            out = model(x)
            loss = loss_fn(out, y)
            loss.backward()
            optimizer.step()
            total += torch.tensor(
                [loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)],
                dtype=torch.float64,
            )
        scheduler.step()
        allreduce(total, comm=comm)
        if dp.is_root():  # 6. log on one rank
            print(
                f"epoch {epoch + 1:3d}/{args.epochs}  train loss {total[0] / total[2]:.4f}  "
                f"train accuracy {total[1] / total[2]:.4f}",
                flush=True,
            )

    # BatchNorm statistics are each rank's own: evaluate with root's, as a checkpoint would.
    dp.synchronize(model)
    model.eval()
    with torch.no_grad():
        predictions = model(torch.from_numpy(x_test)).argmax(1)
    accuracy = (predictions == torch.from_numpy(y_test)).float().mean().item()
    if dp.is_root():
        print(
            f"test accuracy {accuracy:.4f} on {len(y_test)} digits; {world} rank(s); "
            f"{sum(p.numel() for p in model.parameters())} parameters; "
            f"wall time {time.perf_counter() - start:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
