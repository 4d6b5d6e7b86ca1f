"""Layer-parallel training of a residual network on scikit-learn's digits with MGRIT.

Run with ``mpxrun -n 2 -- python examples/train_mgrit_digits.py``. The network
is ``open -> N residual steps x + h tanh(W_k x + b_k) -> close``; its N steps are
split over the ranks in blocks of time. The forward pass is an inexact MGRIT
solve (``--fwd-iters`` V-cycles), the backward pass an MGRIT solve of the
adjoint (``--bwd-iters``), as torchbraid trains::

    digits 8x8 ──> open (64 -> W) ──> [steps 0..a) rank 0 | [a..b) rank 1 | ...] ──> close -> 10
                                      <── forward: MGRIT, backward: adjoint MGRIT ──>

Every rank sees the same batches (they split the layers, not the data). With
``--multilevel-init`` the first half of the epochs trains N/2 steps, which are
then refined to N (weights copied in time) for the second half. Rank 0 prints a
line per epoch and saves the MGRIT residual histories to ``--plot``.
"""

from __future__ import annotations

import argparse
import time

import matplotlib
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from mpx.collectives import world
from mpx.mgrit import LayerParallel, refine

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--steps", type=int, default=32, help="residual steps N")
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--cfactor", type=int, default=2)
    parser.add_argument("--fwd-iters", type=int, default=2)
    parser.add_argument("--bwd-iters", type=int, default=1)
    parser.add_argument("--Tf", type=float, default=2.0)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--multilevel-init", action="store_true")
    parser.add_argument("--plot", default="mgrit_digits_residuals.png")
    return parser.parse_args()


def build(args: argparse.Namespace, steps: int) -> LayerParallel:
    torch.manual_seed(args.seed)  # the same weights on every rank
    return LayerParallel(
        nn.Sequential(nn.Linear(64, args.width), nn.Tanh()),
        nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh()),
        nn.Linear(args.width, 10),
        num_steps=steps, Tf=args.Tf, levels=args.levels, cfactor=args.cfactor,
        fwd_iters=args.fwd_iters, bwd_iters=args.bwd_iters, tol=1e-9,
    )  # fmt: skip


def accuracy(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float((net(x).argmax(1) == y).float().mean())


def main() -> None:
    args = parse_args()
    comm = world()
    # The matrices are small: a second thread per rank only competes for the cores.
    torch.set_num_threads(1)
    digits = load_digits()
    x_train, x_test, y_train, y_test = train_test_split(
        digits.data / 16.0, digits.target, test_size=0.2, random_state=args.seed
    )
    xtr, xte = torch.tensor(x_train, dtype=torch.float32), torch.tensor(x_test, dtype=torch.float32)
    ytr, yte = torch.tensor(y_train), torch.tensor(y_test)
    coarse_epochs = args.epochs // 2 if args.multilevel_init else 0
    net = build(args, args.steps // 2 if coarse_epochs else args.steps)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed)  # the same batches on every rank
    history: list[tuple[list[float], list[float]]] = []
    if comm.rank == 0:
        print(
            f"ranks={comm.size} steps={net.num_steps} levels={args.levels} cfactor={args.cfactor}"
            f" fwd_iters={args.fwd_iters} bwd_iters={args.bwd_iters}"
        )
    for epoch in range(args.epochs):
        if coarse_epochs and epoch == coarse_epochs:
            net = refine(net)
            opt = torch.optim.Adam(net.parameters(), lr=args.lr)
            if comm.rank == 0:
                print(f"refined to {net.num_steps} steps (multilevel initialisation)")
        start, total, count = time.perf_counter(), 0.0, 0
        for idx in torch.split(torch.randperm(len(xtr), generator=gen), args.batch_size):
            loss = nn.functional.cross_entropy(net(xtr[idx]), ytr[idx])
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()
            total, count = total + loss.item() * len(idx), count + len(idx)
        fwd, bwd = net.fwd_stats()["residuals"], net.bwd_stats()["residuals"]
        history.append((list(fwd), list(bwd)))
        # Forward solves are collective: every rank evaluates.
        train_acc, test_acc = accuracy(net, xtr, ytr), accuracy(net, xte, yte)
        if comm.rank == 0:
            print(
                f"epoch {epoch + 1:3d}  loss {total / count:.4f}  "
                f"train acc {train_acc:.3f}  test acc {test_acc:.3f}  "
                f"fwd res {' '.join(f'{r:.1e}' for r in fwd)}  "
                f"bwd res {' '.join(f'{r:.1e}' for r in bwd)}  "
                f"{time.perf_counter() - start:.1f} s",
                flush=True,
            )
    if comm.rank == 0:
        plot(history, args.plot)
        print(f"final test accuracy {test_acc:.3f}; residual plot in {args.plot}")


def plot(history: list[tuple[list[float], list[float]]], path: str) -> None:
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.5), sharey=True)
    # One curve per epoch: a family, coloured by epoch and named by the colour bar.
    cmap = plt.get_cmap("viridis")
    norm = Normalize(vmin=1, vmax=max(2, len(history)))
    for epoch, (fwd, bwd) in enumerate(history):
        colour = cmap(norm(epoch + 1))
        axes[0].semilogy(range(1, len(fwd) + 1), fwd, "o-", color=colour)
        axes[1].semilogy(range(1, len(bwd) + 1), bwd, "o-", color=colour)
    for ax, title, which in zip(axes, ("forward MGRIT", "adjoint MGRIT"), (0, 1), strict=True):
        ax.set_title(f"{title}, last batch of each epoch")
        ax.set_xlabel("iteration")
        # Iterations are integers: integer ticks, one at least (bwd_iters=1 gives one point).
        ax.set_xlim(0.5, max((len(run[which]) for run in history), default=1) + 0.5)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axes[0].set_ylabel("C-point residual norm")
    fig.tight_layout()
    bar = fig.colorbar(ScalarMappable(norm=norm, cmap=cmap), ax=list(axes), pad=0.02)
    bar.set_label("epoch")
    bar.locator = MaxNLocator(integer=True)
    bar.update_ticks()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
