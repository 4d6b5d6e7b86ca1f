"""Data-parallel training of a small network on scikit-learn's digits.

Run with ``mpxrun -n 2 examples/train_digits.py`` (or ``nox -s demo``). Every
rank trains on its own shard of the training set; gradients are averaged by
torch's ``DistributedDataParallel`` on the ``"mpx"`` backend of
``mpx.collectives`` (shared-memory allreduce on one node), with ranks started by
``mpxrun`` from ``mpx.launch``::

    digits (1797 x 8x8) ──split──> train 1437 │ test 360
    train, reshuffled each epoch ──> rank r takes samples r, r+P, r+2P, ...
    per step: local forward/backward ──allreduce(grad)/P──> identical SGD step

Rank 0 prints one line per epoch and the final test accuracy.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from mpx.collectives import init_process_group
from mpx.launch import environment


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )


def main() -> None:
    args = parse_args()
    env = environment()
    init_process_group()  # dist.init_process_group("mpx") with MPI's ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch_size % world:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {world} ranks")

    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        (digits.data / 16.0).astype(np.float32),
        digits.target,
        test_size=0.2,
        random_state=args.seed,
        stratify=digits.target,
    )
    x_train_t, y_train_t = torch.from_numpy(x_train), torch.from_numpy(y_train)
    x_test_t, y_test_t = torch.from_numpy(x_test), torch.from_numpy(y_test)

    torch.manual_seed(args.seed)  # identical initial weights on every rank
    net = make_model()
    model = nn.parallel.DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    local_batch = args.batch_size // world

    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x_train_t), generator=torch.Generator().manual_seed(epoch))
        shard = order[rank::world]
        steps = len(order) // args.batch_size  # same step count on every rank
        total = torch.zeros(2)
        net.train()
        for step in range(steps):
            idx = shard[step * local_batch : (step + 1) * local_batch]
            optimizer.zero_grad()
            loss = loss_fn(model(x_train_t[idx]), y_train_t[idx])
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(idx), len(idx)])
        dist.all_reduce(total)
        if rank == 0:
            print(
                f"epoch {epoch + 1:3d}/{args.epochs}  train loss {total[0] / total[1]:.4f}",
                flush=True,
            )

    net.eval()
    with torch.no_grad():
        accuracy = (model(x_test_t).argmax(1) == y_test_t).float().mean().item()
    # Replicas must not have drifted apart: compare every parameter with rank 0's.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    reference = flat.clone()
    dist.broadcast(reference, 0)
    drift = torch.tensor([(flat - reference).abs().max().item()])
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(
            f"test accuracy {accuracy:.4f} on {len(y_test)} digits; {world} ranks "
            f"({env.launcher}, backend {dist.get_backend()}); "
            f"wall time {time.perf_counter() - start:.1f} s; "
            f"max parameter difference between ranks {drift.item():.1e}"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
