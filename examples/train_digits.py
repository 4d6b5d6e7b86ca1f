"""The main job: distributed training on scikit-learn's digits, with any mpx layer.

``nox -s demo`` runs ``mpxrun -n 2 -- python examples/train_digits.py``: data
parallel with 4-bit compressed gradients. Flags switch the parallelism::

    --mode dp        mpx.dataparallel.DistributedOptimizer, gradients quantized to
                     --bits (4; 0 = full precision) by mpx.quantize      (default)
    --mode ddp       torch DistributedDataParallel on mpx's "mpx" backend
    --mode pipeline  mpx.pipeline: one stage per rank, --schedule any of
                     mpx.pipeline.SCHEDULES (default 1f1b; the interleaved and
                     V-shaped ones put 2 virtual stages on each rank; async
                     steps once per batch, with weight prediction and
                     gap-aware damping: digits_modes_pipeline.async_options)
    --mode mgrit     mpx.mgrit.LayerParallel: residual layers split across ranks,
                     forward and backward solved with MGRIT
    --mode 2d        pipeline x data parallel: --stages stages, the rest replicas
                     (>= 2 of each: 4 ranks or more, MPX_DEMO_RANKS=4)
    --mode gpt       the same 2-D layout on a character-level GPT trained on the
                     standard library's source (examples/train_gpt.py; AdamW,
                     --lr not used); "test accuracy" = next-character accuracy
                     on held-out text

    digits (1797 x 8x8) ──split──> train 1437 │ test 360 (the same split everywhere)

Rank 0 prints one line per epoch (loss, test accuracy, seconds), then a
summary (test accuracy, wall time, bytes communicated), saves the curves to
``--plot`` and the summary as JSON beside it (same name, ``.json``). The
default name says what ran, so no run overwrites another's (examples/demo_runs.py):
``digits_dp_4bit``, ``digits_dp_fp32`` (``--bits 0``), ``digits_ddp``,
``digits_mgrit``, ``digits_pipeline_<schedule>``, ``digits_2d_<schedule>``,
``gpt_stdlib_<schedule>`` (``--mode gpt`` trains on no digits). Bytes
communicated: the tensors all ranks handed to mpx's collectives and
point-to-point operations (with compression, the quantized buffers).

The JSON summary's keys::

    mode                      --mode
    what                      the run in words (the first line printed)
    ranks                     the number of ranks
    epochs                    --epochs
    first_epoch_run           the first epoch (1-based) this attempt trained: 1, or
                              the one after the checkpoint it resumed from
    test_accuracy             the last epoch's test accuracy (0..1)
    wall_time_s               seconds of this attempt's training (from first_epoch_run)
    bytes_communicated        bytes all ranks sent in this attempt (see above)
    loss_spread_across_ranks  max - min over the ranks of the last epoch's loss (0:
                              the replicas agree)
    loss                      per epoch, the training loss (resumed epochs included)
    accuracy                  per epoch, the test accuracy
    epoch_seconds             per epoch, seconds
    plot                      the PNG's path
    plot_labels               the panels' axis labels and titles, the loss axis' scale

``--checkpoint-dir DIR`` saves the run every ``--checkpoint-every`` epochs
(``mpx.dataparallel.save_resumable``) and resumes from DIR's newest
checkpoint at start, so under ``mpxrun --max-restarts N`` a job that loses a
rank continues where it stopped and ends as an uninterrupted run would.
``MPX_DEMO_FAIL_AT=E:R`` makes rank R kill itself (SIGKILL) at the start of
epoch E of the first attempt, to watch it::

    rm -rf ckpt && MPX_DEMO_FAIL_AT=3:1 mpxrun -n 2 --max-restarts 1 -- \
        python examples/train_digits.py --checkpoint-dir ckpt

A first attempt that finds checkpoints in DIR (an earlier job's) says so and
continues that run; when that run had finished (its newest checkpoint is at
``--epochs``) there is nothing to train: it says how to start afresh and
leaves the summary and plot of the earlier run as they are. Checkpoints of
other flags (another mode, schedule or --bits: ``demo_run.json`` in DIR names
them) are refused, saying which run wrote them.

This script reads the flags, runs the epochs and writes the summary; the rest
lies in modules beside it: ``digits_data`` (the data, the network, the
record), ``digits_layout`` (the ranks' layouts, the run's name),
``digits_modes_dp``, ``digits_modes_pipeline``, ``digits_modes_mgrit`` (the
modes), ``digits_checkpoint`` (--checkpoint-dir, MPX_DEMO_FAIL_AT),
``digits_plot`` and ``demo_runs`` (run names, checkpoint owners).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mpx.collectives import allreduce, broadcast, bytes_communicated, world
from mpx.pipeline import SCHEDULES

# The job's modules lie beside this file and import each other by name: run as a
# script, this folder is on sys.path already; loaded by path (tests/test_demo_plots.py)
# it is not.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import (
        digits_checkpoint,
        digits_data,
        digits_layout,
        digits_modes_dp,
        digits_modes_mgrit,
        digits_modes_pipeline,
        digits_plot,
    )
else:
    import digits_checkpoint
    import digits_data
    import digits_layout
    import digits_modes_dp
    import digits_modes_mgrit
    import digits_modes_pipeline
    import digits_plot

__all__ = ["MODES", "main", "parse_args"]

MODES = ("dp", "ddp", "pipeline", "mgrit", "2d", "gpt")

# What tests/test_demo_plots.py draws and names runs with, by these names.
History = digits_data.History
plot = digits_plot.plot
panel_labels = digits_plot.panel_labels
_run_name = digits_layout.name_and_flags


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="dp")
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="global batch size (default: the multiple nearest 64 that the layout divides)",
    )
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--bits", type=int, default=4, help="dp: gradient bits (0: fp32)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b",
                        help="pipeline/2d/gpt: the pipeline's schedule (default 1f1b)")  # fmt: skip
    parser.add_argument(
        "--chunks",
        type=int,
        help="pipeline/2d/gpt: micro-batches (default 4, or 2 per stage beyond 2 stages: the "
        "interleaved schedules run micro-batches in rounds of one per stage, DualPipeV needs 2 "
        "per stage)",
    )
    parser.add_argument("--stages", type=int, default=0, help="2d: stages (default: 2 if even)")
    parser.add_argument("--steps", type=int, default=8, help="mgrit: residual layers")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot", default=None, help="PNG file (default: named by mode, schedule, bits)"
    )
    parser.add_argument("--checkpoint-dir", default=None, help="save here; resume from here")
    parser.add_argument(
        "--checkpoint-every", type=int, default=1, help="with --checkpoint-dir: epochs per save"
    )
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    comm = world()
    if args.chunks is None:
        stages = comm.size if args.mode == "pipeline" else digits_layout.pipeline_stages(args, comm)
        args.chunks = max(4, 2 * stages)
    if args.batch_size is None:
        args.batch_size = digits_layout.default_batch_size(args, comm)
    if args.batch_size % comm.size:
        digits_layout.stop(
            f"mpx demo: --batch-size {args.batch_size} must be divisible by {comm.size} ranks", comm
        )
    data = digits_data.load(args.seed)
    history = digits_data.History()
    if args.mode == "dp":
        epoch = digits_modes_dp.data_parallel(args, data, comm)
        what = f"data parallel, {'fp32' if not args.bits else f'{args.bits}-bit'} gradients"
    elif args.mode == "ddp":
        epoch = digits_modes_dp.torch_ddp(args, data, comm)
        what = "torch DDP on the mpx backend"
    elif args.mode == "pipeline":
        epoch = digits_modes_pipeline.pipeline(args, data, comm)
        what = f"pipeline, {comm.size} stage(s), {args.schedule}, {args.chunks} micro-batches"
    elif args.mode == "2d":
        epoch = digits_modes_pipeline.two_dimensional(args, data, comm)
        stages = digits_layout.pipeline_stages(args, comm)
        layout = digits_layout.layout_words(stages, comm.size // stages)
        what = f"{layout}, {args.schedule}"
    elif args.mode == "gpt":
        epoch = digits_modes_pipeline.gpt_2d(args, comm)
        stages = digits_layout.pipeline_stages(args, comm)
        layout = digits_layout.layout_words(stages, comm.size // stages)
        what = f"GPT on the standard library, {layout}, {args.schedule}"
    else:
        epoch = digits_modes_mgrit.layer_parallel(args, data, comm, history)
        what = f"layer-parallel (MGRIT), {args.steps} residual layers"
    if comm.rank == 0:
        print(
            f"mpx demo: {what}; {comm.size} rank(s); {args.epochs} epochs; "
            f"global batch {args.batch_size}",
            flush=True,
        )
    first = digits_checkpoint.resume(args, comm, history) if args.checkpoint_dir else 0
    if digits_checkpoint.nothing_to_train(args, first, comm):
        # No summary: it would overwrite the finished run's with zero time and bytes.
        broadcast(torch.zeros(1), 0, comm=comm)  # leave together
        return
    digits_checkpoint.failure_skipped(first, comm)
    start = time.perf_counter()
    bytes_before = bytes_communicated()
    for index in range(first, args.epochs):
        digits_checkpoint.fail_if_asked(index, comm)
        tick = time.perf_counter()
        loss, acc = epoch(index)
        history.loss.append(loss)
        history.accuracy.append(acc)
        history.seconds.append(time.perf_counter() - tick)
        if comm.rank == 0:
            bar = "#" * (20 * (index + 1) // args.epochs)
            extra = ""
            if history.residuals and history.residuals[-1]:
                extra = f"  MGRIT residual {history.residuals[-1][-1]:.1e}"
            print(
                f"[{bar:<20}] epoch {index + 1:3d}/{args.epochs}  loss {loss:.4f}  "
                f"test acc {100 * acc:5.1f}%  {history.seconds[-1]:.2f} s{extra}",
                flush=True,
            )
        if args.checkpoint_dir:
            digits_checkpoint.checkpoint(args, comm, index + 1, history)
    wall = time.perf_counter() - start
    sent = torch.tensor([float(bytes_communicated() - bytes_before)], dtype=torch.float64)
    allreduce(sent, comm=comm)
    # Every rank must hold the same model where it is replicated: check the loss agrees.
    check = torch.tensor([history.loss[-1]], dtype=torch.float64)
    spread = check.clone()
    allreduce(spread, "max", comm=comm)
    allreduce(check, "min", comm=comm)
    path = args.plot or f"{_run_name(args)[0]}.png"
    if comm.rank == 0:
        labels = digits_plot.panel_labels(args.mode)
        digits_plot.plot(history, path, f"mpx: {what}, {comm.size} ranks", labels)
        summary = {
            "mode": args.mode,
            "what": what,
            "ranks": comm.size,
            "epochs": args.epochs,
            # Wall time and bytes are this attempt's: from this epoch (1-based) on.
            "first_epoch_run": first + 1,
            "test_accuracy": history.accuracy[-1],
            "wall_time_s": wall,
            "bytes_communicated": int(sent[0]),
            "loss_spread_across_ranks": float(spread[0] - check[0]),
            "loss": history.loss,
            "accuracy": history.accuracy,
            "epoch_seconds": history.seconds,
            "plot": path,
            "plot_labels": asdict(labels),
        }
        summary_path = path.rsplit(".", 1)[0] + ".json"
        with open(summary_path, "w") as f:
            json.dump(summary, f, indent=1)
        print(
            f"summary: {what}; {comm.size} rank(s); final test accuracy "
            f"{100 * history.accuracy[-1]:.1f}%; wall time {wall:.1f} s "
            f"({wall / max(1, args.epochs - first):.2f} s/epoch); "
            f"{sent[0] / 2**20:.1f} MiB communicated; "
            f"loss spread across ranks {float(spread[0] - check[0]):.1e}; plot {path}; "
            f"summary {summary_path}",
            flush=True,
        )
    broadcast(torch.zeros(1), 0, comm=comm)  # leave together


if __name__ == "__main__":
    main()
