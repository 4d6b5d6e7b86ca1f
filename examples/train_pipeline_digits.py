"""Pipeline-parallel training of an MLP on scikit-learn's digits, one stage per rank.

    mpxrun -n 3 --timeout 600 -- python examples/train_pipeline_digits.py --schedule 1f1b
    mpxrun -n 2 -- python examples/train_pipeline_digits.py --schedule async \
        --prediction msnag --gap-aware ga

The layers are balanced over the ranks by measured time (``balance=None``).
The last stage prints each epoch's mean loss and test accuracy; ``--plot``
writes the curves to a PNG.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from mpx.collectives import world
from mpx.pipeline import SCHEDULES, Pipeline


def model() -> nn.Sequential:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(
        nn.Linear(64, 128),
        nn.ReLU(),
        nn.Dropout(0.1),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, default="gpipe")
    parser.add_argument("--checkpoint", choices=["never", "except_last", "always"], default="never")
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--prediction", choices=["msnag", "aggmsnag"], default=None)
    parser.add_argument("--gap-aware", choices=["ga", "ga_jfl"], default=None)
    parser.add_argument("--no-stashing", action="store_true")
    parser.add_argument("--recompute", action="store_true")
    parser.add_argument(
        "--step-every", type=int, default=1, help="async: micro-batches per optimizer step"
    )
    parser.add_argument("--plot", default=None, help="write loss/accuracy curves to this PNG")
    args = parser.parse_args()

    comm = world()
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        torch.tensor(x / 16.0, dtype=torch.float32),
        torch.tensor(y),
        test_size=0.25,
        random_state=0,
    )
    async_opts: dict[str, Any] = {}
    if args.schedule == "async":
        async_opts = {
            "weight_stashing": not args.no_stashing,
            "weight_prediction": args.prediction,
            "gap_aware": args.gap_aware,
            "recompute": args.recompute,
            "step_every": args.step_every,
        }
    pipe = Pipeline(
        model(),
        balance=None,
        sample=x_train[: args.batch // args.chunks],
        chunks=args.chunks,
        schedule=args.schedule,
        checkpoint="never" if args.schedule == "async" else args.checkpoint,
        **async_opts,
    )
    # Balancing by time may leave a stage with only activations: no optimizer there.
    params = list(pipe.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9) if params else None
    if pipe.last:
        print(
            f"{comm.size} stage(s), balance {pipe.balance}, schedule {args.schedule}, "
            f"chunks {args.chunks}",
            flush=True,
        )
    generator = torch.Generator().manual_seed(1)  # the same shuffles on every rank
    # The test set padded to a multiple of chunks (the padding is not scored).
    pad = (-len(x_test)) % args.chunks
    x_eval = torch.cat([x_test, x_test[:pad]])
    history = []
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        pipe.train()
        order = torch.randperm(len(x_train), generator=generator)
        losses = []
        for i in range(0, len(order) - args.batch + 1, args.batch):
            idx = order[i : i + args.batch]
            losses.append(
                pipe.step(x_train[idx], y_train[idx], nn.functional.cross_entropy, optimizer)
            )
        pipe.eval()
        out = pipe(x_eval)
        if pipe.last:
            assert out is not None
            accuracy = float((out[: len(x_test)].argmax(1) == y_test).float().mean())
            # async reports each call's loss one call late (NaN on the first).
            known = [v for v in losses if not math.isnan(v)]
            loss = sum(known) / max(len(known), 1)
            history.append((loss, accuracy))
            print(
                f"epoch {epoch:3d}  loss {loss:.4f}  test accuracy {accuracy:.4f}  "
                f"({time.perf_counter() - start:.1f} s)",
                flush=True,
            )
    pipe.flush(optimizer)
    if pipe.last:
        print(f"final test accuracy {history[-1][1]:.4f}", flush=True)
        if args.plot:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt

            fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
            a.plot([h[0] for h in history])
            a.set(xlabel="epoch", ylabel="train loss")
            b.plot([h[1] for h in history])
            b.set(xlabel="epoch", ylabel="test accuracy")
            fig.suptitle(f"{comm.size} stages, {args.schedule}")
            fig.tight_layout()
            fig.savefig(args.plot)


if __name__ == "__main__":
    main()
