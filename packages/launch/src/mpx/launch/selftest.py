"""``python -m mpx.launch.selftest``: the launch-only smoke test, without torch.

``mpxrun --check`` runs it on 2 ranks with whatever is installed: every rank
reads its place from the launcher (:func:`mpx.launch.environment`) and, when
mpi4py is there, checks it against MPI's own ranks and sums the ranks with an
allreduce. Rank 0 prints one line; the exit code is non-zero on any mismatch.
"""

from __future__ import annotations

import importlib.util
import sys

from mpx.launch.environment import environment

__all__ = ["main"]


def main() -> int:
    """Runs the check on this rank; returns its exit code."""
    env = environment()
    problems: list[str] = []
    if importlib.util.find_spec("mpi4py") is None:
        summary = "launcher ok (mpi4py not installed: MPI not exercised)"
    else:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        if (comm.Get_rank(), comm.Get_size()) != (env.rank, env.world_size):
            problems.append(
                f"the launcher says rank {env.rank} of {env.world_size}, MPI says "
                f"{comm.Get_rank()} of {comm.Get_size()}"
            )
        total = comm.allreduce(env.rank)
        want = env.world_size * (env.world_size - 1) // 2
        if total != want:
            problems.append(f"allreduce of the ranks gave {total}, want {want}")
        summary = f"MPI ok: {comm.Get_size()} ranks, allreduce exact"
    for problem in problems:
        print(f"rank {env.rank}: {problem}", file=sys.stderr)
    if env.rank == 0 and not problems:
        print(f"  launch {summary}", flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
