"""The main job: distributed training on scikit-learn's digits, with any mpx layer.

``nox -s demo`` runs ``mpxrun -n 2 -- python examples/train_digits.py``: data
parallel with 4-bit compressed gradients. Flags switch the parallelism::

    --mode dp        mpx.dataparallel.DistributedOptimizer, gradients quantized to
                     --bits (4; 0 = full precision) by mpx.quantize      (default)
    --mode ddp       torch DistributedDataParallel on mpx's "mpx" backend
    --mode pipeline  mpx.pipeline: one stage per rank, --schedule any of
                     mpx.pipeline.SCHEDULES (default 1f1b; the interleaved and
                     V-shaped ones put 2 virtual stages on each rank)
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
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

from mpx.collectives import Communicator, allreduce, broadcast, bytes_communicated, world
from mpx.launch.settings import RESTART_COUNT, declare
from mpx.pipeline import SCHEDULES
from mpx.pipeline.schedule import stages_per_rank

MODES = ("dp", "ddp", "pipeline", "mgrit", "2d", "gpt")
GPT_STEPS_PER_EPOCH = 10

FAIL_AT = declare(
    "MPX_DEMO_FAIL_AT",
    "str",
    "",
    "examples/train_digits.py: 'E:R' makes rank R kill itself at the start of epoch E of the "
    "first attempt (MPX_RESTART_COUNT 0), to watch mpxrun --max-restarts resume the job",
    package="demo",
)


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
    parser.add_argument("--chunks", type=int, default=4, help="pipeline/2d: micro-batches")
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


# -- the modes: each returns a function that trains one epoch and evaluates -----


def data_parallel(args: argparse.Namespace, data: Data, comm: Communicator) -> Callable[..., Any]:
    import mpx.dataparallel as dp

    torch.manual_seed(args.seed)
    model = dp.synchronize(mlp())
    compression = None
    if args.bits:
        from mpx.quantize import CompressionConfig

        # minimal_size 0: with this small model every weight matrix is compressed.
        compression = CompressionConfig(bits=args.bits, bucket_size=512, minimal_size=0)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = dp.DistributedOptimizer(inner, model, compression=compression)
    RESUMABLE.append(Resumable(model, opt, sharded=False))
    return _replicated_epoch(args, data, comm, model, model, opt)


def _replicated_epoch(
    args: argparse.Namespace,
    data: Data,
    comm: Communicator,
    model: nn.Module,
    net: nn.Module,
    opt: torch.optim.Optimizer,
) -> Callable[..., Any]:
    """One epoch of data parallel training: rank r takes every P-th sample of each batch.

    ``model`` is what runs forward (DDP's wrapper, or the network itself), ``net``
    the network (for train/eval and the accuracy).
    """
    loss_fn = nn.CrossEntropyLoss()

    def epoch(index: int) -> tuple[float, float]:
        net.train()
        total = torch.zeros(2, dtype=torch.float64)
        for batch in batches(data, index, args.batch_size):
            mine = batch[comm.rank :: comm.size]
            opt.zero_grad()
            loss = loss_fn(model(data.x_train[mine]), data.y_train[mine])
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64)
        allreduce(total, comm=comm)
        net.eval()
        return float(total[0] / total[1]), accuracy_of(net, data)

    return epoch


def torch_ddp(args: argparse.Namespace, data: Data, comm: Communicator) -> Callable[..., Any]:
    from mpx.collectives import init_process_group

    init_process_group()
    torch.manual_seed(args.seed)
    net = mlp()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    RESUMABLE.append(Resumable(net, opt, sharded=False))
    return _replicated_epoch(args, data, comm, model, net, opt)


def _pipeline_epoch(
    args: argparse.Namespace,
    data: Data,
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
        for batch in batches(data, index, args.batch_size):
            mine = batch[replica::replicas]
            losses.append(pipe.step(data.x_train[mine], data.y_train[mine], loss_fn, opt))
        if args.schedule == "async":
            # async step() returns the previous call's loss (NaN first): flush adds the last.
            losses = [*losses[1:], pipe.flush(opt)]
        # The last stage predicts; its accuracy goes to every rank.
        with torch.no_grad():
            out = pipe(data.x_test)
        acc = torch.tensor([accuracy_of(lambda _: out, data) if out is not None else -1.0])
        allreduce(acc, "max", comm=comm)
        # Stages of one replica agree on the loss; replicas average theirs.
        loss = torch.tensor([float(np.mean(losses))], dtype=torch.float64)
        allreduce(loss, "avg", comm=comm)
        return float(loss[0]), float(acc[0])

    return epoch


def pipeline(args: argparse.Namespace, data: Data, comm: Communicator) -> Callable[..., Any]:
    from mpx.pipeline import Pipeline

    torch.manual_seed(args.seed)
    model = mlp()
    pipe = Pipeline(model, balance=_balance(len(model), comm.size, args.schedule), comm=comm,
                    chunks=args.chunks, schedule=args.schedule)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    RESUMABLE.append(Resumable(pipe, opt, sharded=True))
    return _pipeline_epoch(args, data, pipe, opt, comm)


def two_dimensional(args: argparse.Namespace, data: Data, comm: Communicator) -> Callable[..., Any]:
    from mpx.pipeline import Pipeline

    stages, replica, stage_comm, replica_comm = _layouts(args, comm)
    replicas = comm.size // stages
    torch.manual_seed(args.seed)
    model = mlp()
    pipe = Pipeline(model, balance=_balance(len(model), stages, args.schedule), comm=stage_comm,
                    chunks=args.chunks, schedule=args.schedule,
                    data_parallel_comm=replica_comm)  # fmt: skip
    opt = torch.optim.SGD(pipe.parameters(), lr=args.lr, momentum=0.9)
    RESUMABLE.append(Resumable(pipe, opt, sharded=True))
    return _pipeline_epoch(args, data, pipe, opt, comm, replica, replicas)


def _stages(args: argparse.Namespace, comm: Communicator) -> int:
    """Pipeline stages of the 2-D layouts: --stages, else 2 on an even rank count."""
    return int(args.stages or (2 if comm.size % 2 == 0 else 1))


def _layout_words(stages: int, replicas: int) -> str:
    """What a stages x replicas layout is, in words: only the parallelisms that run."""
    if stages > 1 and replicas > 1:
        return f"pipeline x data parallel, {stages} stages x {replicas} replicas"
    if stages > 1:
        return f"pipeline, {stages} stages"
    if replicas > 1:
        return f"data parallel, {replicas} replicas"
    return "1 stage, 1 replica"


def default_batch_size(args: argparse.Namespace, comm: Communicator) -> int:
    """The multiple nearest 64 of what every rank's share needs (64 at 2 and 4 ranks).

    Each rank takes an equal share; a pipeline cuts a replica's share into
    --chunks micro-batches. So with the default, any rank count runs
    (``MPX_DEMO_RANKS=3``: 60 or 63), where a fixed 64 stopped at 3 ranks.
    """
    unit = comm.size
    if args.mode in ("pipeline", "2d", "gpt"):
        replicas = 1 if args.mode == "pipeline" else comm.size // _stages(args, comm)
        unit = math.lcm(comm.size, replicas * args.chunks)
    return max(unit, round(64 / unit) * unit)


def _layouts(args: argparse.Namespace, comm: Communicator) -> tuple[int, int, Any, Any]:
    """(stages, replica, stage comm, replica comm) of the 2-D layouts."""
    stages = _stages(args, comm)
    if comm.size % stages:
        raise SystemExit(f"--stages {stages} must divide the {comm.size} ranks")
    refusal = _runs().two_d_refusal(comm.size, stages)
    if args.mode == "2d" and refusal:
        stop(refusal, comm)  # every rank computes the same layout
    # rank = replica * stages + stage:   stage comm = same replica, dp comm = same stage
    stage_comm = comm.split(comm.rank // stages)
    replica_comm = comm.split(comm.rank % stages)
    assert stage_comm is not None
    assert replica_comm is not None
    return stages, comm.rank // stages, stage_comm, replica_comm


@functools.cache
def _runs() -> ModuleType:
    """examples/demo_runs.py: run names, the 2-D layouts refused, checkpoint owners."""
    return _example("demo_runs")


def stop(message: str, comm: Communicator) -> None:
    """Ends the job, every rank saying why: called by every rank alike."""
    print(message, file=sys.stderr, flush=True)
    # All have said it before any exits: mpxrun stops the others at the first exit.
    allreduce(torch.zeros(1), comm=comm)
    raise SystemExit(1)


def _run_name(args: argparse.Namespace) -> tuple[str, str]:
    """(the outputs' stem, the flags that make this run)."""
    return (_runs().run_name(args.mode, args.schedule, args.bits),
            _runs().run_flags(args.mode, args.schedule, args.bits))  # fmt: skip


def _example(name: str) -> ModuleType:
    """Another example of this folder, by path (the examples are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def gpt_2d(args: argparse.Namespace, comm: Communicator) -> Callable[..., Any]:
    """Pipeline x data parallel on the small GPT of ``examples/train_gpt.py``.

    An epoch is ``GPT_STEPS_PER_EPOCH`` steps of ``--batch-size`` windows of
    32 characters; the accuracy is the next character's on held-out windows.
    """
    from mpx.pipeline import Pipeline

    example = _example("train_gpt")
    stages, replica, stage_comm, replica_comm = _layouts(args, comm)
    replicas = comm.size // stages
    ids = example.load_corpus(300_000)
    train, held_out = ids[: len(ids) * 9 // 10], ids[len(ids) * 9 // 10 :]
    torch.manual_seed(args.seed)
    model = example.gpt(len(example.ALPHABET), width=64, blocks=2, heads=4, context=32)
    async_opts = {"step_every": args.chunks} if args.schedule == "async" else {}
    virtual = stages * stages_per_rank(args.schedule, None)
    pipe = Pipeline(model, balance=example.balance(len(model), virtual), comm=stage_comm,
                    chunks=args.chunks, schedule=args.schedule,
                    data_parallel_comm=replica_comm, **async_opts)  # fmt: skip
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3, weight_decay=0.01)
    RESUMABLE.append(Resumable(pipe, opt, sharded=True))
    gen = torch.Generator()
    share = args.batch_size // replicas
    mine = slice(replica * share, (replica + 1) * share)
    held_out_gen = torch.Generator().manual_seed(7)
    test_x, test_y = example.windows(held_out, args.batch_size, 32, held_out_gen)

    def epoch(index: int) -> tuple[float, float]:
        pipe.train()
        losses = []
        # Seeded per epoch: a run resumed at epoch k draws the windows an uninterrupted one does.
        gen.manual_seed(args.seed + 1 + 1009 * index)
        for _ in range(GPT_STEPS_PER_EPOCH):
            x, y = example.windows(train, args.batch_size, 32, gen)
            losses.append(pipe.step(x[mine], y[mine], example.next_char_loss, opt))
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


def layer_parallel(
    args: argparse.Namespace, data: Data, comm: Communicator, history: History
) -> Callable[..., Any]:
    from mpx.mgrit import LayerParallel

    torch.manual_seed(args.seed)
    net = LayerParallel(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.Tanh()),
        nn.Linear(64, 10),
        num_steps=args.steps,
        Tf=1.0,
        comm=comm,
        levels=2,
        cfactor=2,
        fwd_iters=2,
        bwd_iters=1,
    )
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    RESUMABLE.append(Resumable(net, opt, sharded=True))
    loss_fn = nn.CrossEntropyLoss()

    def epoch(index: int) -> tuple[float, float]:
        net.train()
        losses = []
        for batch in batches(data, index, args.batch_size):
            opt.zero_grad()
            loss = loss_fn(net(data.x_train[batch]), data.y_train[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        history.residuals.append(list(net.fwd_stats().get("residuals", [])))
        net.eval()
        return float(np.mean(losses)), accuracy_of(net, data)

    return epoch


def _balance(layers: int, ranks: int, schedule: str) -> list[int]:
    """Layers per virtual stage, as even as possible (the first stages take the extra).

    The interleaved and V-shaped schedules run 2 virtual stages per rank.
    """
    stages = ranks * stages_per_rank(schedule, None)
    if stages > layers:
        raise SystemExit(
            f"{stages} pipeline stages ({ranks} rank(s) x {stages // ranks} for --schedule "
            f"{schedule}) but the model has only {layers} layers: use fewer ranks or another "
            "--schedule"
        )
    return [layers // stages + (1 if s < layers % stages else 0) for s in range(stages)]


# -- driver --------------------------------------------------------------------


def resume(args: argparse.Namespace, comm: Communicator, history: History) -> int:
    """Loads the newest checkpoint of --checkpoint-dir, if any; the epoch to start at."""
    import mpx.dataparallel as dp

    if not RESUMABLE:
        raise SystemExit(f"--checkpoint-dir: --mode {args.mode} does not save checkpoints")
    if args.checkpoint_every < 1:
        raise SystemExit(f"--checkpoint-every must be >= 1, got {args.checkpoint_every}")
    run = RESUMABLE[0]
    # Another mode's (or schedule's) checkpoints would fail to load with missing keys: say whose.
    refusal = _runs().check_owner(args.checkpoint_dir, *_run_name(args))
    if refusal:
        stop(refusal, comm)  # every rank reads the same file
    point = dp.resume(args.checkpoint_dir, run.model, run.optimizer, comm=comm)
    if point.path is not None:
        for name, values in point.extra["history"].items():
            setattr(history, name, values)
        # A restart (mpxrun --max-restarts) resumes this job's own checkpoints; the
        # first attempt finding some resumes an earlier job's: say it, it may be stale.
        earlier = RESTART_COUNT.get() == 0
        if comm.rank == 0 and earlier and point.epoch < args.epochs:
            print(
                f"mpx demo: {args.checkpoint_dir} holds an earlier run's checkpoints "
                f"(newest: {point.path}, after epoch {point.epoch}); continuing that run. "
                f"To start afresh, remove it: rm -r {args.checkpoint_dir}",
                flush=True,
            )
        if comm.rank == 0 and point.epoch < args.epochs:
            print(f"resumed from {point.path} at epoch {point.epoch + 1}", flush=True)
    return point.epoch


def nothing_to_train(args: argparse.Namespace, first: int, comm: Communicator) -> bool:
    """True, having said why, when the checkpoint resumed is at or past --epochs."""
    if first < args.epochs:
        return False
    if comm.rank == 0:
        print(
            f"mpx demo: nothing to train: {args.checkpoint_dir} is a finished run "
            f"({first} of --epochs {args.epochs} done). Remove it (rm -r "
            f"{args.checkpoint_dir}) to train again, or raise --epochs to continue it; "
            "the summary and plot of that run are left as they are",
            flush=True,
        )
    return True


def failure_skipped(first: int, comm: Communicator) -> None:
    """Says so when MPX_DEMO_FAIL_AT's epoch lies before the epoch the run resumes at."""
    wanted = FAIL_AT.get()
    if not wanted or RESTART_COUNT.get() != 0 or comm.rank != 0:
        return
    at_epoch = wanted.split(":")[0]
    if at_epoch.isdigit() and int(at_epoch) <= first:
        print(
            f"mpx demo: MPX_DEMO_FAIL_AT={wanted}: no failure injected: epoch {at_epoch} "
            f"was done before the checkpoint this run resumes from",
            flush=True,
        )


def checkpoint(args: argparse.Namespace, comm: Communicator, done: int, history: History) -> None:
    """Saves the run after ``done`` epochs, every --checkpoint-every and at the end."""
    import mpx.dataparallel as dp

    if done % args.checkpoint_every and done != args.epochs:
        return
    run = RESUMABLE[0]
    dp.save_resumable(args.checkpoint_dir, run.model, run.optimizer, epoch=done, batch=0,
                      sharded=run.sharded, comm=comm, history=asdict(history))  # fmt: skip
    if comm.rank == 0:
        _runs().record_owner(args.checkpoint_dir, *_run_name(args))


def fail_if_asked(epoch: int, comm: Communicator) -> None:
    """MPX_DEMO_FAIL_AT=E:R: rank R dies at the start of epoch E (1-based), first attempt only."""
    wanted = FAIL_AT.get()
    if not wanted or RESTART_COUNT.get() != 0:
        return
    try:
        at_epoch, at_rank = (int(part) for part in wanted.split(":"))
    except ValueError:
        raise SystemExit(f"MPX_DEMO_FAIL_AT={wanted!r}: expected EPOCH:RANK, e.g. 3:1") from None
    if (epoch + 1, comm.rank) == (at_epoch, at_rank):
        os.write(2, f"mpx demo: MPX_DEMO_FAIL_AT={wanted}: rank {comm.rank} kills itself "
                    f"at the start of epoch {epoch + 1}\n".encode())  # fmt: skip
        os.kill(os.getpid(), signal.SIGKILL)


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
    xlabel=f"epoch ({GPT_STEPS_PER_EPOCH} steps)",
    loss="training loss (nats/char)",
    loss_title="next-character cross-entropy",
    accuracy="next-character accuracy (%)",
    accuracy_title="held-out source text",
    loss_scale="linear",
)


def panel_labels(mode: str) -> PanelLabels:
    return GPT_LABELS if mode == "gpt" else DIGITS_LABELS


def plot(history: History, path: str, title: str, labels: PanelLabels = DIGITS_LABELS) -> None:
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


def main() -> None:
    args = parse_args()
    comm = world()
    if args.batch_size is None:
        args.batch_size = default_batch_size(args, comm)
    if args.batch_size % comm.size:
        raise SystemExit(f"--batch-size {args.batch_size} must be divisible by {comm.size} ranks")
    data = load(args.seed)
    history = History()
    if args.mode == "dp":
        epoch = data_parallel(args, data, comm)
        what = f"data parallel, {'fp32' if not args.bits else f'{args.bits}-bit'} gradients"
    elif args.mode == "ddp":
        epoch = torch_ddp(args, data, comm)
        what = "torch DDP on the mpx backend"
    elif args.mode == "pipeline":
        epoch = pipeline(args, data, comm)
        what = f"pipeline, {comm.size} stage(s), {args.schedule}, {args.chunks} micro-batches"
    elif args.mode == "2d":
        epoch = two_dimensional(args, data, comm)
        layout = _layout_words(_stages(args, comm), comm.size // _stages(args, comm))
        what = f"{layout}, {args.schedule}"
    elif args.mode == "gpt":
        epoch = gpt_2d(args, comm)
        layout = _layout_words(_stages(args, comm), comm.size // _stages(args, comm))
        what = f"GPT on the standard library, {layout}, {args.schedule}"
    else:
        epoch = layer_parallel(args, data, comm, history)
        what = f"layer-parallel (MGRIT), {args.steps} residual layers"
    if comm.rank == 0:
        print(
            f"mpx demo: {what}; {comm.size} rank(s); {args.epochs} epochs; "
            f"global batch {args.batch_size}",
            flush=True,
        )
    first = resume(args, comm, history) if args.checkpoint_dir else 0
    if nothing_to_train(args, first, comm):
        # No summary: it would overwrite the finished run's with zero time and bytes.
        broadcast(torch.zeros(1), 0, comm=comm)  # leave together
        return
    failure_skipped(first, comm)
    start = time.perf_counter()
    bytes_before = bytes_communicated()
    for index in range(first, args.epochs):
        fail_if_asked(index, comm)
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
            checkpoint(args, comm, index + 1, history)
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
        labels = panel_labels(args.mode)
        plot(history, path, f"mpx: {what}, {comm.size} ranks", labels)
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
