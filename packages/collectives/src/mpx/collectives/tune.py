"""Measure every implementation on this machine and rank layout; write the policy ``auto`` reads.

Run it under any launcher, with the ranks the jobs will have::

    mpxrun -n 4 --tune             # = mpxrun -n 4 -- python -m mpx.collectives.tune
    mpiexec -n 4 python -m mpx.collectives.tune --max-size 64M --output policy.json

For each op of :data:`mpx.collectives.core.policy.TUNABLE` and each size from
4 KiB to ``--max-size`` (x4 steps), it times every CPU implementation that
can run the op on this layout (the best of bursts of calls lasting >= 10 ms,
each burst the slowest rank's, as the benchmarks do), prints the table, and writes the winner of
each size band into the policy file: the file ``auto`` reads
(``MPX_POLICY_FILE``, or ``~/.cache/mpx/policy-<host>.json``; see
:func:`mpx.collectives.core.policy.default_policy_file`). Band edges lie halfway
(geometrically) between measured sizes. Layouts already in the file (other
rank counts) are kept; the one measured is replaced.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from mpx.collectives.core import (
    COMPARE_ONLY,
    IMPLEMENTATIONS,
    TUNABLE,
    Communicator,
    PolicyError,
    allgather,
    allreduce,
    broadcast,
    choose,
    default_policy_file,
    layout_key,
    reduce_scatter,
    world,
)
from mpx.launch.settings import parse_size

__all__ = [
    "TIE",
    "bands_from",
    "candidates",
    "main",
    "measure",
    "time_interleaved",
    "write_policy",
]

# Sizes above this many bytes are not timed for the ops whose output is
# size x input (allgather) or that need size x input of memory per rank.
_GATHER_LIMIT = 64 << 20
_LAST = 1 << 62  # the last band's (exclusive) upper bound: every size


def candidates(op: str, comm: Communicator) -> list[str]:
    """The CPU implementations that run ``op`` themselves on this communicator."""
    names = []
    for name in IMPLEMENTATIONS:
        if name in COMPARE_ONLY:
            continue  # torch's process groups: auto never runs them, so no band may name them
        try:
            if choose(op, False, 1 << 20, comm, name) == name:
                names.append(name)
        except PolicyError:
            continue  # not for this layout or device
    return names


def _runner(op: str, impl: str, nbytes: int, comm: Communicator) -> Callable[[], object]:
    n = max(comm.size, nbytes // 4 // comm.size * comm.size)
    if op == "allreduce":
        t = torch.ones(n)
        return lambda: allreduce(t, comm=comm, impl=impl)
    if op == "broadcast":
        t = torch.ones(n)
        return lambda: broadcast(t, 0, comm=comm, impl=impl)
    if op == "allgather":
        t = torch.ones(max(1, n // comm.size))  # output: n elements
        return lambda: allgather(t, comm=comm, impl=impl)
    t = torch.ones(comm.size, n // comm.size)
    return lambda: reduce_scatter(t, comm=comm, impl=impl)


# A sample lasts at least this long (at most _MAX_BURST calls), so that the
# ranks' skew leaving the barrier is not most of what is measured: where
# ranks outnumber cores, the last one out may wait a scheduler slice.
_SAMPLE_S = 10e-3
_MAX_BURST = 1024


def _burst(fn: Callable[[], object], mpi: MPI.Comm) -> int:
    """Calls per sample, the same on every rank: from the slowest rank's time of a call."""
    mpi.Barrier()
    start = time.perf_counter()
    for _ in range(3):
        fn()
    per_call = mpi.allreduce((time.perf_counter() - start) / 3, op=MPI.MAX)
    return max(1, min(_MAX_BURST, int(_SAMPLE_S / max(per_call, 1e-9))))


def time_interleaved(
    runners: dict[str, Callable[[], object]],
    mpi: MPI.Comm,
    rounds: int,
    per_round: int,
    before_turn: Callable[[str], None] | None = None,
) -> dict[str, float]:
    """Seconds per call of each runner: its best sample, each sample the slowest rank's.

    A sample is a burst of calls after a barrier lasting >= 10 ms (at most
    1024 calls; the burst is sized on the runner's first turn, the same on
    every rank). The runners take turns, ``per_round`` samples each, over
    ``rounds`` rounds, each round starting at another runner, so that a burst
    of load on the machine hits them all alike and no runner always follows
    the same neighbour. Load from elsewhere, and a rank left waiting for a
    core, only ever add time: the best sample is the runner's own cost (a
    median moved 1.2-1.5x between runs of the same code on 3 ranks and 2
    cores, and the tuned policy followed that noise). ``before_turn(name)``
    runs on every rank before each turn (the benchmark sets a policy there).
    The tuner and ``benchmarks/bench_allreduce.py`` both measure with this.
    """
    names = list(runners)
    bursts: dict[str, int] = {}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(rounds):
        first = round_ % len(names)
        for name in names[first:] + names[:first]:
            fn = runners[name]
            if before_turn is not None:
                before_turn(name)
            if name not in bursts:
                bursts[name] = _burst(fn, mpi)
            for _ in range(per_round):
                mpi.Barrier()
                start = time.perf_counter()
                for _ in range(bursts[name]):
                    fn()
                samples[name].append((time.perf_counter() - start) / bursts[name])
    best = {}
    for name, mine in samples.items():
        slowest = np.asarray(mine)
        mpi.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        best[name] = float(slowest.min())
    return best


def _row(op: str, names: list[str], nbytes: int, comm: Communicator) -> dict[str, float]:
    """Seconds per call of each implementation (:func:`time_interleaved`)."""
    runners = {impl: _runner(op, impl, nbytes, comm) for impl in names}
    for fn in runners.values():
        for _ in range(2):
            fn()  # warm-up: workspaces, page faults
    repeats = max(6, min(60, (64 << 20) // max(nbytes, 1) * 3 // 64))
    rounds = 3
    return time_interleaved(runners, comm.mpi, rounds, max(2, repeats // rounds))


def sizes_up_to(max_bytes: int) -> list[int]:
    sizes, n = [], 4 << 10
    while n <= max_bytes:
        sizes.append(n)
        n *= 4
    return sizes


def measure(
    comm: Communicator, ops: list[str], max_bytes: int, progress: bool = True
) -> dict[str, dict[int, dict[str, float]]]:
    """op -> size -> implementation -> seconds, for every candidate."""
    times: dict[str, dict[int, dict[str, float]]] = {}
    for op in ops:
        names = candidates(op, comm)
        limit = (
            min(max_bytes, _GATHER_LIMIT) if op in ("allgather", "reduce_scatter") else max_bytes
        )
        times[op] = {}
        for nbytes in sizes_up_to(limit):
            row = _row(op, names, nbytes, comm)
            times[op][nbytes] = row
            if progress and comm.rank == 0:
                best = min(row, key=row.__getitem__)
                cells = "  ".join(f"{impl} {s * 1e3:8.3f}" for impl, s in row.items())
                print(f"{op:<15}{_label(nbytes):>8}  {cells}   best {best}", flush=True)
    return times


# Implementations within this factor of the fastest count as tied: the band
# keeps the previous size's winner then, rather than flip on noise.
TIE = 1.05


def bands_from(
    measured: dict[int, dict[str, float]], builtin: Callable[[int], str] | None = None
) -> list[tuple[int, str]]:
    """``[(up_to, winner)]``: edges halfway (geometrically) between measured sizes.

    A size's winner is the fastest implementation, except that a measurement
    within :data:`TIE` of the fastest is a tie, and a tie goes to the previous
    size's winner, else to the built-in rules' choice (``builtin(nbytes)``):
    noise alone never moves ``auto`` away from what it would do untuned.
    """
    sizes = sorted(measured)
    bands: list[tuple[int, str]] = []
    for i, nbytes in enumerate(sizes):
        row = measured[nbytes]
        winner = min(row, key=row.__getitem__)
        tied = [name for name, seconds in row.items() if seconds <= TIE * row[winner]]
        if bands and bands[-1][1] in tied:
            winner = bands[-1][1]
        elif builtin is not None and builtin(nbytes) in tied:
            winner = builtin(nbytes)
        up_to = int(math.sqrt(nbytes * sizes[i + 1])) if i + 1 < len(sizes) else _LAST
        if bands and bands[-1][1] == winner:
            bands[-1] = (up_to, winner)
        else:
            bands.append((up_to, winner))
    return bands


def _for_op(builtin: Callable[[str, int], str] | None, op: str) -> Callable[[int], str] | None:
    return None if builtin is None else (lambda nbytes: builtin(op, nbytes))


def _label(nbytes: int) -> str:
    if nbytes >= 1 << 20:
        return f"{nbytes >> 20} MiB"
    return f"{nbytes >> 10} KiB"


def write_policy(
    path: Path,
    layout: str,
    times: dict[str, dict[int, dict[str, float]]],
    builtin: Callable[[str, int], str] | None = None,
) -> None:
    """Adds (replaces) ``layout``'s bands in the file at ``path``, atomically."""
    data: dict[str, Any] = {"version": 1, "layouts": {}}
    if path.is_file():
        try:
            data = json.loads(path.read_text())
            data.setdefault("layouts", {})
        except ValueError:
            data = {"version": 1, "layouts": {}}
    data["layouts"][layout] = {
        "bands": {
            op: [[up, impl] for up, impl in bands_from(rows, _for_op(builtin, op))]
            for op, rows in times.items()
        },
        "measured_seconds": {
            op: {str(size): row for size, row in rows.items()} for op, rows in times.items()
        },
        "host": platform.node(),
        "cores": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mpx.collectives.tune", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--max-size", default="256M", help="largest size timed (default 256M)")
    parser.add_argument(
        "--ops", default=",".join(TUNABLE), help=f"ops to tune (default {','.join(TUNABLE)})"
    )
    parser.add_argument("--output", default=None, help="policy file (default: what auto reads)")
    args = parser.parse_args(argv)
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = [op for op in ops if op not in TUNABLE]
    if unknown:
        parser.error(f"--ops: {unknown} cannot be tuned; choose from {', '.join(TUNABLE)}")
    try:
        max_bytes = parse_size(args.max_size)
    except ValueError:
        parser.error(f"--max-size {args.max_size!r} is not a size such as 64M or 1G")
    comm = world()
    path = Path(args.output) if args.output else default_policy_file()
    if comm.rank == 0:
        print(f"tuning {', '.join(ops)} on {layout_key(comm)} (times in ms)", flush=True)
    times = measure(comm, ops, max_bytes)
    if comm.rank == 0:
        write_policy(path, layout_key(comm), times)
        for op, rows in times.items():
            bands = ", ".join(
                f"< {_label(up) if up < _LAST else 'any'}: {impl}" for up, impl in bands_from(rows)
            )
            print(f"{op}: {bands}", flush=True)
        print(f"wrote {path}", flush=True)
    comm.mpi.Barrier()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
