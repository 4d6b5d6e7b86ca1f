"""The 2-rank jobs of ``nox -s wheelhouse``, run where only the wheels are installed.

``python job.py pipeline`` (after ``pip install mpx-pipeline``), ``python job.py
dataparallel`` (after ``pip install mpx-dataparallel[quantize]``) and ``python job.py
launch`` (after ``pip install mpx-launch[mpich]``, on Python 3.10), under ``mpxrun -n 2``.
The session copies this file into a temporary directory and runs it with a fresh
environment's python: the source tree is not on the path, and each job first checks
that every mpx module it uses comes from that environment's site-packages.
"""

from __future__ import annotations

import importlib
import os
import sys
from importlib.metadata import version
from pathlib import Path


def say(line: str) -> None:
    """One ``os.write`` per line: print() interleaves between ranks."""
    os.write(1, (line + "\n").encode())


def check_installed(*distributions: str) -> str:
    """Each distribution (``mpx-pipeline``) imports from this environment's site-packages.

    Returns ``name version`` pairs for the log; exits if a module comes from
    anywhere else (the source tree on the path, an editable install).
    """
    prefix = Path(sys.prefix).resolve()
    found = []
    for distribution in distributions:
        module = importlib.import_module("mpx." + distribution.removeprefix("mpx-"))
        location = Path(str(module.__file__)).resolve()
        if not location.is_relative_to(prefix) or "site-packages" not in location.parts:
            raise SystemExit(f"{distribution} imported from {location}, not from {prefix}")
        found.append(f"{distribution} {version(distribution)}")
    return ", ".join(found)


def pipeline() -> None:
    """Two stages of a 1F1B pipeline learn, and agree on the loss."""
    import torch
    from torch import nn

    from mpx.collectives import world
    from mpx.pipeline import Pipeline

    installed = check_installed("mpx-pipeline", "mpx-collectives", "mpx-launch")
    comm = world()
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )
    pipe = Pipeline(model, balance=[2, 3], chunks=4, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(64, 16, generator=generator)
    y = torch.randint(0, 4, (64,), generator=generator)
    losses = [pipe.step(x, y, nn.functional.cross_entropy, opt) for _ in range(20)]
    if not losses[-1] < losses[0]:
        raise SystemExit(f"the pipeline did not learn: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    if len({tuple(each) for each in comm.allgather_object(losses)}) != 1:
        raise SystemExit("the stages returned different losses")
    say(f"rank {comm.rank}/{comm.size}: pipeline ok ({installed}); loss {losses[-1]:.3f}")


def dataparallel() -> None:
    """Data parallel with 4-bit gradients: the replicas stay equal, the kernels ran."""
    import torch
    from torch import nn

    import mpx.dataparallel as dp
    from mpx.quantize import CompressionConfig

    installed = check_installed("mpx-dataparallel", "mpx-quantize", "mpx-collectives")
    comm = dp.init()
    torch.manual_seed(0)
    model = dp.synchronize(nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4)))
    compression = CompressionConfig(bits=4, bucket_size=512, minimal_size=0)  # every matrix
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = dp.DistributedOptimizer(inner, model, compression=compression)
    generator = torch.Generator().manual_seed(1 + comm.rank)  # each rank its own data
    x = torch.randn(64, 16, generator=generator)
    y = torch.randint(0, 4, (64,), generator=generator)
    for _ in range(10):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    # The compiled kernels of the repaired wheel quantized the gradients.
    if "mpx.quantize._cpu" not in sys.modules:
        raise SystemExit("mpx.quantize's CPU kernels were not loaded: no gradient was quantized")
    weights = torch.cat([p.detach().flatten() for p in model.parameters()]).numpy().tobytes()
    if len(set(comm.allgather_object(weights))) != 1:
        raise SystemExit("the replicas' weights differ after the steps")
    say(f"rank {comm.rank}/{comm.size}: dataparallel[quantize] ok ({installed})")


def launch() -> None:
    """mpx-launch alone (no torch) on the lowest Python it supports: mpxrun starts MPI ranks."""
    from mpi4py import MPI

    installed = check_installed("mpx-launch")
    comm = MPI.COMM_WORLD
    total = comm.allreduce(comm.rank + 1)
    if total != comm.size * (comm.size + 1) // 2:
        raise SystemExit(f"allreduce of rank + 1 gave {total}")
    python = ".".join(map(str, sys.version_info[:2]))
    say(f"rank {comm.rank}/{comm.size}: launch ok ({installed}) on Python {python}")


def imports() -> None:
    """Every installed mpx package imports, from site-packages, on every rank (nox -s compat)."""
    from importlib.metadata import distributions

    from mpx.collectives import world

    names = sorted(
        {d.metadata["Name"] for d in distributions() if d.metadata["Name"].startswith("mpx-")}
    )
    installed = check_installed(*names)
    comm = world()
    comm.allgather_object(None)  # every rank got here
    say(f"rank {comm.rank}/{comm.size}: imports ok ({installed})")


if __name__ == "__main__":
    jobs = {
        "pipeline": pipeline,
        "dataparallel": dataparallel,
        "launch": launch,
        "imports": imports,
    }
    jobs[sys.argv[1]]()
