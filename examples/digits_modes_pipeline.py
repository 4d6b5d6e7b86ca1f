"""The main job's pipeline modes (examples/train_digits.py ``--mode pipeline``, ``2d``, ``gpt``).

Each returns a function that trains one epoch and evaluates:

* :func:`pipeline`: mpx.pipeline, one stage per rank (2 virtual stages per
  rank for the interleaved and V-shaped schedules).
* :func:`two_dimensional`: pipeline x data parallel, --stages stages, the
  rest replicas.
* :func:`gpt_2d`: the same 2-D layout on the small GPT of examples/train_gpt.py.

``--schedule async`` (PipeDream's 1F1B, no flush) trains on stale weights: a
stage's gradient is computed on weights its stage has stepped since. The
digits modes use the remedies mpx.pipeline provides (:func:`async_options`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mpx.collectives import Communicator, allreduce
from mpx.pipeline.schedules import stages_per_rank

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import digits_data, digits_layout, train_gpt
else:  # run as scripts: this folder is on sys.path
    import digits_data
    import digits_layout
    import train_gpt

__all__ = ["async_options", "gpt_2d", "pipeline", "two_dimensional"]


def async_options(args: argparse.Namespace) -> dict[str, Any]:
    """The asynchronous schedule's staleness remedies for the digits modes (none otherwise).

    * ``step_every=chunks``: one optimizer step per global batch, on the mean
      gradient of its micro-batches, as the synchronous schedules take; a step
      per micro-batch (16 samples at lr 0.05, momentum 0.9) takes 4x as many
      steps on gradients up to ``stages - 1`` steps stale.
    * ``weight_prediction="msnag"``: each forward runs on the weights SGD with
      momentum will have when its gradient is applied.
    * ``gap_aware="ga"``: a gradient is damped by how far its weights have
      moved since it was computed.

    Without them the demo's end was chance: at 2 ranks seed 0 ended at 96.7 or
    94.7 % by the thread count alone, at 3 it diverged (20-40 %, seeds 0-2); with
    them 95.8-97.8 % at 2 ranks and 96.9-97.8 % at 3, seeds 0-4, 20 epochs
    (packages/pipeline/README.md, "Example: digits").
    """
    if args.schedule != "async":
        return {}
    return {"step_every": args.chunks, "weight_prediction": "msnag", "gap_aware": "ga"}


def _pipeline_epoch(
    args: argparse.Namespace,
    data: digits_data.Data,
    pipe: Any,
    opt: torch.optim.Optimizer,
    comm: Communicator,
    replica: int = 0,
    replicas: int = 1,
) -> Callable[..., Any]:
    """One epoch of a pipeline; replica r of R (2-D) takes every R-th sample of each batch."""
    loss_fn = nn.CrossEntropyLoss()

    def epoch(index: int) -> tuple[float, float]:
        losses = []
        for batch in digits_data.batches(data, index, args.batch_size):
            mine = batch[replica::replicas]
            losses.append(pipe.step(data.x_train[mine], data.y_train[mine], loss_fn, opt))
        if args.schedule == "async":
            # async step() returns the previous call's loss (NaN first): flush adds the last.
            losses = [*losses[1:], pipe.flush(opt)]
        # The last stage predicts; its accuracy goes to every rank.
        with torch.no_grad():
            out = pipe(data.x_test)
        acc = torch.tensor(
            [digits_data.accuracy_of(lambda _: out, data) if out is not None else -1.0]
        )
        allreduce(acc, "max", comm=comm)
        # Stages of one replica agree on the loss; replicas average theirs.
        loss = torch.tensor([float(np.mean(losses))], dtype=torch.float64)
        allreduce(loss, "avg", comm=comm)
        return float(loss[0]), float(acc[0])

    return epoch


def pipeline(
    args: argparse.Namespace, data: digits_data.Data, comm: Communicator
) -> Callable[..., Any]:
    from mpx.pipeline import Pipeline

    torch.manual_seed(args.seed)
    model = digits_data.mlp()
    balance = digits_layout.balance(len(model), comm.size, args.schedule)
    pipe = Pipeline(model, balance=balance, comm=comm, chunks=args.chunks,
                    schedule=args.schedule, **async_options(args))  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    digits_data.RESUMABLE.append(digits_data.Resumable(pipe, opt, sharded=True))
    return _pipeline_epoch(args, data, pipe, opt, comm)


def two_dimensional(
    args: argparse.Namespace, data: digits_data.Data, comm: Communicator
) -> Callable[..., Any]:
    from mpx.pipeline import Pipeline

    stages, replica, stage_comm, replica_comm = digits_layout.layouts(args, comm)
    replicas = comm.size // stages
    torch.manual_seed(args.seed)
    model = digits_data.mlp()
    balance = digits_layout.balance(len(model), stages, args.schedule)
    pipe = Pipeline(model, balance=balance, comm=stage_comm, chunks=args.chunks,
                    schedule=args.schedule, data_parallel_comm=replica_comm,
                    **async_options(args))  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    digits_data.RESUMABLE.append(digits_data.Resumable(pipe, opt, sharded=True))
    return _pipeline_epoch(args, data, pipe, opt, comm, replica, replicas)


def gpt_2d(args: argparse.Namespace, comm: Communicator) -> Callable[..., Any]:
    """Pipeline x data parallel on the small GPT of ``examples/train_gpt.py``.

    An epoch is ``GPT_STEPS_PER_EPOCH`` steps of ``--batch-size`` windows of
    32 characters; the accuracy is the next character's on held-out windows.
    """
    from mpx.pipeline import Pipeline

    stages, replica, stage_comm, replica_comm = digits_layout.layouts(args, comm)
    replicas = comm.size // stages
    ids = train_gpt.load_corpus(300_000)
    train, held_out = ids[: len(ids) * 9 // 10], ids[len(ids) * 9 // 10 :]
    torch.manual_seed(args.seed)
    model = train_gpt.gpt(len(train_gpt.ALPHABET), width=64, blocks=2, heads=4, context=32)
    async_opts = {"step_every": args.chunks} if args.schedule == "async" else {}
    virtual = stages * stages_per_rank(args.schedule, None)
    pipe = Pipeline(model, balance=train_gpt.balance(len(model), virtual), comm=stage_comm,
                    chunks=args.chunks, schedule=args.schedule,
                    data_parallel_comm=replica_comm, **async_opts)  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.01)
    digits_data.RESUMABLE.append(digits_data.Resumable(pipe, opt, sharded=True))
    gen = torch.Generator()
    share = args.batch_size // replicas
    mine = slice(replica * share, (replica + 1) * share)
    held_out_gen = torch.Generator().manual_seed(7)
    test_x, test_y = train_gpt.windows(held_out, args.batch_size, 32, held_out_gen)

    def epoch(index: int) -> tuple[float, float]:
        pipe.train()
        losses = []
        # Seeded per epoch: a run resumed at epoch k draws the windows an uninterrupted one does.
        gen.manual_seed(args.seed + 1 + 1009 * index)
        for _ in range(digits_data.GPT_STEPS_PER_EPOCH):
            x, y = train_gpt.windows(train, args.batch_size, 32, gen)
            losses.append(pipe.step(x[mine], y[mine], train_gpt.next_char_loss, opt))
        if args.schedule == "async":
            losses = [*losses[1:], pipe.flush(opt)]
        pipe.eval()
        with torch.no_grad():
            logits = pipe(test_x[mine])
        # The last stage of each replica scores its share; the replicas' shares average.
        hits = torch.zeros(2, dtype=torch.float64)
        if logits is not None:
            hits += torch.tensor([float((logits.argmax(-1) == test_y[mine]).float().mean()), 1.0])
        allreduce(hits, comm=comm)
        return float(np.mean(losses)), float(hits[0] / hits[1])

    return epoch
