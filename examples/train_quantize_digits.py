"""DDP on scikit-learn's digits with 4-bit compressed gradients, against float32.

Run with ``mpxrun -n 2 -- python examples/train_quantize_digits.py``. The same
network is trained twice from the same initialisation: once with DDP's own
float32 allreduce, once with mpx-quantize's communication hook (CGX's
scatter-reduce-allgather at ``--bits`` bits, biases in full precision)::

    per step: local backward ──ddp_comm_hook──> quantize peers' chunks ── alltoall
              ──> owner: dequantize_add, /P, re-quantize ── allgather ──> identical SGD step

Rank 0 prints one line per epoch, the test accuracies, the bytes each rank
sent, and saves the loss curves to ``--plot`` (matplotlib, Agg backend).
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import mpx.quantize as mq
from mpx.collectives import init_process_group


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--bucket-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="train_quantize_digits.png")
    return parser.parse_args()


def train(
    args: argparse.Namespace, data: list[torch.Tensor], state: mq.QuantizeState | None
) -> tuple[list[float], float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(args.seed)
    model = nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    ddp = nn.parallel.DistributedDataParallel(model)
    label = "float32"
    if state is not None:
        state.names.update({id(p): n for n, p in model.named_parameters()})
        ddp.register_comm_hook(state, mq.ddp_comm_hook)
        label = f"{args.bits}-bit"
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    order = torch.Generator().manual_seed(args.seed)
    losses = []
    for epoch in range(args.epochs):
        perm = torch.randperm(len(y_train), generator=order)
        total, count = 0.0, 0
        for start in range(0, len(perm) - args.batch_size + 1, args.batch_size):
            mine = perm[start : start + args.batch_size][rank::world]
            opt.zero_grad()
            loss = loss_fn(ddp(x_train[mine]), y_train[mine])
            loss.backward()
            opt.step()
            total += loss.item()
            count += 1
        mean = torch.tensor(total / count)
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if rank == 0:
            print(
                f"[{label}] epoch {epoch + 1:2d}/{args.epochs}: loss {losses[-1]:.4f}", flush=True
            )
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    return losses, accuracy


def main() -> None:
    args = parse_args()
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
    )
    data = [
        torch.from_numpy(x_train),
        torch.from_numpy(y_train),
        torch.from_numpy(x_test),
        torch.from_numpy(y_test),
    ]
    full_losses, full_accuracy = train(args, data, None)
    config = mq.CompressionConfig(bits=args.bits, bucket_size=args.bucket_size)
    state = mq.QuantizeState(config)
    losses, accuracy = train(args, data, state)
    if rank == 0:
        print(f"test accuracy: float32 {full_accuracy:.4f}, {args.bits}-bit {accuracy:.4f}")
        if world > 1:
            print(
                f"bytes sent per rank: {state.bytes_sent / 2**20:.2f} MiB compressed vs "
                f"{state.bytes_uncompressed / 2**20:.2f} MiB float32 "
                f"({state.bytes_sent / state.bytes_uncompressed:.3f})"
            )
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        epochs = range(1, args.epochs + 1)
        ax.plot(epochs, full_losses, label=f"float32 ({full_accuracy:.3f})")
        ax.plot(epochs, losses, label=f"{args.bits}-bit mpx.quantize ({accuracy:.3f})")
        ax.set_xlabel("epoch")
        ax.set_ylabel("training loss")
        ax.set_yscale("log")
        ax.set_title(f"digits, DDP on {world} ranks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot)
        print(f"loss curves: {args.plot}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
