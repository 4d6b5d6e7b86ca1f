"""A failed call's error carries the grid of the call, marked where the rank stopped.

Size-agnostic (1, 2 or 3 ranks, one block per rank): the last stage raises in
the forward of micro-batch 1; every stage raises ``PipelineRemoteError``, and
each one's note draws the schedule near the action it stopped at (torch's
pipelining prints its schedule the same way when a step fails).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpx.collectives import Communicator, world
from mpx.pipeline import Pipeline, PipelineRemoteError, grid

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

D, CHUNKS = 4, 4


class RaiseAt(nn.Module):
    """The identity, but for its ``at``-th call (from 0), which raises."""

    def __init__(self, at: int | None) -> None:
        super().__init__()
        self.at, self.seen = at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        if self.seen - 1 == self.at:
            raise ValueError("injected failure in a forward")
        return x


def _failing_pipeline(comm: Communicator, schedule: str) -> Pipeline:
    """A stage per rank, each a Linear and a RaiseAt; the last stage's raises
    in the forward of micro-batch 1 (its second call)."""
    p, last = comm.size, comm.size - 1
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for s in range(p):
        layers += [nn.Linear(D, D), RaiseAt(1 if s == last else None)]
    return Pipeline(
        nn.Sequential(*layers).double(),
        [2] * p,
        comm=Communicator.from_mpi(comm.mpi, 60.0),
        chunks=CHUNKS,
        schedule=schedule,
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "async"])
def test_the_error_draws_where_each_rank_stopped(schedule: str) -> None:
    comm = world()
    p, last = comm.size, comm.size - 1
    pipe = _failing_pipeline(comm, schedule)
    x = torch.randn(CHUNKS, D, dtype=torch.float64)
    y = torch.randn(CHUNKS, D, dtype=torch.float64)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(PipelineRemoteError) as info:
        pipe.step(x, y, nn.functional.mse_loss, opt)
    error = info.value
    assert error.ranks == [last], str(error)
    # The message is the same on every rank; the note is this rank's own.
    assert "injected failure in a forward" in str(error)
    notes = getattr(error, "__notes__", [])
    assert len(notes) == 1, notes
    lines = notes[0].splitlines()
    assert lines[0] == f"Pipeline.step (schedule={schedule!r}) on rank {comm.rank}:"
    assert any(f" rank {comm.rank} stopped here (" in line for line in lines), notes[0]
    if comm.rank != last:
        return
    if schedule == "async":
        # The stream's other ranks' lists are theirs: this rank's list, in its order.
        rows = [f"stage {last} | F0 B0 F1 B1 F2 B2 F3 B3"]
        mark = 0
    else:
        rows = grid(schedule, p, CHUNKS).splitlines()
        mark = last
    assert lines[1 : mark + 2] + lines[mark + 3 :] == rows
    caret = lines[mark + 2]
    assert caret.index("^^") == rows[mark].index("F1")
    assert caret.endswith(f"^^ rank {last} stopped here ({last}F1)")


def test_a_failed_evaluation_draws_its_forwards() -> None:
    comm = world()
    p, last = comm.size, comm.size - 1
    pipe = _failing_pipeline(comm, "1f1b")
    with pytest.raises(PipelineRemoteError) as info:
        pipe(torch.randn(CHUNKS, D, dtype=torch.float64))
    assert info.value.ranks == [last], str(info.value)
    if comm.rank != last:
        return
    lines = info.value.__notes__[0].splitlines()
    assert lines[0] == f"Pipeline.forward (schedule='1f1b') on rank {last}:"
    # Forwards only: stage r starts r steps late (idle steps drawn as dots).
    rows = [
        f"stage {r} | " + " ".join([". "] * r + ["F0", "F1", "F2", "F3"] + [". "] * (p - 1 - r))
        for r in range(p)
    ]
    rows = [row.rstrip() for row in rows]
    assert lines[1 : last + 2] == rows
    assert lines[last + 2].index("^^") == rows[last].index("F1")
    assert lines[last + 2].endswith(f"rank {last} stopped here ({last}F1)")
