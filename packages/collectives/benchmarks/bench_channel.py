"""A pipeline's message round trip through :class:`mpx.collectives.Channel`, beside mpi4py.

``python bench_channel.py`` starts itself under ``mpxrun -n 2`` and prints
one markdown section (``nox -s bench -- bench_channel`` writes it into
BENCHMARKS.md). Rank 0 sends a float32 activation, rank 1 sends a tensor of
the same size back (its gradient), as neighbouring pipeline stages do, by:

- mpi4py: ``Irecv`` posted, ``Isend``, both waited, on prepared numpy
  arrays -- the MPI calls alone, the reference of the ratio;
- the channel as mpx-pipeline uses it: the activation with a header on a
  stream (a marker after the first), the gradient's receive posted with
  ``like=`` before the activation leaves, received buffers given back to
  the pool -- its CPU data going straight to MPI (``channel_wire.DataRequest``);
- the same with its data through ``mpx.collectives.send``/``recv``'s general
  path, as before that (a subclass routing the data parts there).

The variants take turns within each round (``--rounds`` rounds of ``--trips``
round trips, after a barrier); a round's figure is the slower rank's mean per
round trip. The table gives the median and the ratio to mpi4py per round
(median, and the range).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

SIZES = (4 << 10, 128 << 10, 4 << 20)  # bytes of the activation


def measure(rounds: int, trips: int) -> None:
    """Runs inside the job on 2 ranks: both time, rank 0 prints table rows."""
    import torch
    from mpi4py import MPI

    from mpx.collectives import Channel, Handle, recv, send, world

    class GeneralPath(Channel):
        """The channel with its data parts through the public send/recv (the old path)."""

        def _send(self, wire: torch.Tensor, peer: int, tag: int) -> Handle[Any]:
            return send(wire, peer, tag, comm=self.comm, async_op=True)

        def _recv(self, buf: torch.Tensor, peer: int, tag: int) -> Handle[Any]:
            handle = recv(buf, peer, tag, comm=self.comm, async_op=True)
            self._posted[(peer, tag)] += 1
            return handle

    torch.set_num_threads(1)
    comm = world()
    raw = MPI.COMM_WORLD.Dup()
    rank, peer = comm.rank, 1 - comm.rank

    def variants_for(x: torch.Tensor) -> dict[str, Callable[[], None]]:
        out, back = x.numpy().copy(), x.numpy().copy()
        like = [(x.shape, x.dtype)]

        def mpi4py_trips() -> None:
            for _ in range(trips):
                if rank == 0:
                    r = raw.Irecv(back, source=peer, tag=2)
                    raw.Isend(out, dest=peer, tag=1).Wait()
                    r.Wait()
                else:
                    raw.Irecv(back, source=peer, tag=1).Wait()
                    raw.Isend(back, dest=peer, tag=2).Wait()

        def channel_trips(ch: Channel) -> Callable[[], None]:
            def run() -> None:
                for _ in range(trips):
                    if rank == 0:
                        grad = ch.expect(peer, 2, like=like)
                        sent = ch.post(peer, 1, x, header=True, stream=0)
                        message = ch.receive(grad)
                        ch.release(message.tensors)
                        ch.wait(sent)
                    else:
                        message = ch.receive(ch.expect(peer, 1, stream=0))
                        ch.wait(ch.post(peer, 2, message.tensors))
                        ch.release(message.tensors)

            return run

        return {
            "mpi4py Isend/Irecv, prepared arrays": mpi4py_trips,
            "mpx Channel (CPU data straight to MPI)": channel_trips(Channel(comm)),
            "mpx Channel, data through send/recv's general path": channel_trips(GeneralPath(comm)),
        }

    for nbytes in SIZES:
        variants = variants_for(torch.randn(nbytes // 4))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for run in variants.values():
            run()  # warm-up: connections, pooled buffers, the stream's first header
        for _ in range(rounds):
            for name, run in variants.items():
                raw.Barrier()
                start = time.perf_counter()
                run()
                mean = (time.perf_counter() - start) / trips
                times[name].append(float(raw.allreduce(mean, op=MPI.MAX)))
        if rank == 0:
            reference = times[next(iter(variants))]
            size = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
            for name, samples in times.items():
                ratios = sorted(s / r for s, r in zip(samples, reference, strict=True))
                print(
                    f"| {size} | {name} | {statistics.median(samples) * 1e6:.0f} | "
                    f"{statistics.median(ratios):.2f} | {ratios[0]:.2f}–{ratios[-1]:.2f} |",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--trips", type=int, default=500)
    args = parser.parse_args()
    if args.inside:
        measure(args.rounds, args.trips)
        return
    import torch

    print("## mpx-collectives: a pipeline's message round trip through Channel\n")
    print(
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
        f"Python {platform.python_version()}; 2 ranks, one thread each; "
        f"`python {os.path.basename(__file__)} --rounds {args.rounds} --trips {args.trips}`. "
        "A float32 activation to rank 1 and a tensor of the same size back; the median over "
        "rounds of the slower rank's mean round trip, and its ratio to mpi4py's per round.\n"
    )
    print("| activation | variant | round trip (us) | ÷ mpi4py (median) | range |")
    print("|---|---|---|---|---|")
    mpxrun = shutil.which("mpxrun") or os.path.join(os.path.dirname(sys.executable), "mpxrun")
    subprocess.run(
        [mpxrun, "-n", "2", "--timeout", "900", "--", sys.executable, os.path.abspath(__file__),
         "--inside", "--rounds", str(args.rounds), "--trips", str(args.trips)],
        check=True,
    )  # fmt: skip


if __name__ == "__main__":
    main()
