"""How the main job lays its ranks out, and what a run is called (examples/train_digits.py).

* :func:`pipeline_stages`, :func:`layouts`, :func:`layout_words`: the 2-D
  layouts (``--mode 2d`` and ``gpt``), stages x replicas, and their words.
* :func:`balance`: the layers of each virtual stage of a pipeline.
* :func:`default_batch_size`: the global batch every rank count divides.
* :func:`name_and_flags`: the run's outputs' stem and its flags
  (examples/demo_runs.py), :func:`stop`: ends the job, every rank saying why.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from mpx.collectives import Communicator, allreduce
from mpx.pipeline.schedules import stages_per_rank

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import demo_runs
else:  # run as scripts: this folder is on sys.path
    import demo_runs

__all__ = [
    "balance",
    "default_batch_size",
    "layout_words",
    "layouts",
    "name_and_flags",
    "pipeline_stages",
    "stop",
]


def pipeline_stages(args: argparse.Namespace, comm: Communicator) -> int:
    """Pipeline stages of the 2-D layouts: --stages, else 2 on an even rank count."""
    return int(args.stages or (2 if comm.size % 2 == 0 else 1))


def layout_words(stages: int, replicas: int) -> str:
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
        replicas = 1 if args.mode == "pipeline" else comm.size // pipeline_stages(args, comm)
        unit = math.lcm(comm.size, replicas * args.chunks)
    return max(unit, round(64 / unit) * unit)


def layouts(args: argparse.Namespace, comm: Communicator) -> tuple[int, int, Any, Any]:
    """(stages, replica, stage comm, replica comm) of the 2-D layouts."""
    stages = pipeline_stages(args, comm)
    if comm.size % stages:
        stop(f"mpx demo: --stages {stages} must divide the {comm.size} ranks", comm)
    refusal = demo_runs.two_d_refusal(comm.size, stages)
    if args.mode == "2d" and refusal:
        stop(refusal, comm)  # every rank computes the same layout
    # rank = replica * stages + stage:   stage comm = same replica, dp comm = same stage
    stage_comm = comm.split(comm.rank // stages)
    replica_comm = comm.split(comm.rank % stages)
    assert stage_comm is not None
    assert replica_comm is not None
    return stages, comm.rank // stages, stage_comm, replica_comm


def balance(layers: int, ranks: int, schedule: str) -> list[int]:
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


def stop(message: str, comm: Communicator) -> NoReturn:
    """Ends the job as a usage error, rank 0 saying why: called by every rank alike.

    Exit code 2 is the shells' and argparse's "bad usage": mpxrun then passes it
    on without a rank-failure report, so the message is printed once.
    """
    if comm.rank == 0:
        print(message, file=sys.stderr, flush=True)
    # Rank 0 has said it before any rank exits: mpxrun stops the others at the first exit.
    allreduce(torch.zeros(1), comm=comm)
    raise SystemExit(2)


def name_and_flags(args: argparse.Namespace) -> tuple[str, str]:
    """(the outputs' stem, the flags that make this run)."""
    return (demo_runs.run_name(args.mode, args.schedule, args.bits),
            demo_runs.run_flags(args.mode, args.schedule, args.bits))  # fmt: skip
