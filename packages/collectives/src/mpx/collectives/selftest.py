"""``python -m mpx.collectives.selftest``: a short check of every CPU implementation.

Run under any number of ranks (``mpxrun --check`` runs it on 2): each
implementation allreduces and broadcasts a few sizes and dtypes, compared
with the exact answer; rank 0 prints one line per implementation and the
process exits non-zero if any is wrong.
"""

from __future__ import annotations

import sys
import time

import torch

from mpx.collectives.core import allreduce, broadcast, choose, world

__all__ = ["main"]

_CPU_IMPLS = ("mpi", "ring", "shm", "hier", "auto")


def _check(impl: str) -> str | None:
    """None if ``impl`` gives exact answers here, else what went wrong."""
    comm = world()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        for n in (1, 1000, 300_001):
            t = torch.full((n,), comm.rank + 1, dtype=dtype)
            allreduce(t, impl=impl, timeout=60)
            want = comm.size * (comm.size + 1) // 2
            if not bool(torch.all(t == want)):
                return f"allreduce {dtype} n={n}: got {t[0].item()}, want {want}"
            root = comm.size - 1
            b = torch.full((n,), comm.rank, dtype=dtype)
            broadcast(b, root, impl=impl, timeout=60)
            if not bool(torch.all(b == root)):
                return f"broadcast {dtype} n={n}: got {b[0].item()}, want {root}"
    return None


def main() -> int:
    comm = world()
    failures = 0
    for impl in _CPU_IMPLS:
        try:
            choose("allreduce", False, 1 << 18, comm, impl)
        except ValueError:
            if comm.rank == 0:
                print(f"  {impl:<5} not applicable to this layout", flush=True)
            continue
        start = time.perf_counter()
        problem = _check(impl)
        took = time.perf_counter() - start
        wrong = comm.mpi.allreduce(1 if problem else 0)
        failures += wrong
        if comm.rank == 0:
            status = "ok" if not wrong else f"WRONG on {wrong} rank(s): {problem}"
            print(f"  {impl:<5} {status} ({took * 1e3:.0f} ms)", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
