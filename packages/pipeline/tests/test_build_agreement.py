"""Pipeline(...) built differently on different ranks: the same clear error on every rank.

Before the agreement, ``balance=[3, 3]`` on rank 0 and ``[2, 4]`` on rank 1
trained with a wrong loss and exit 0; other differences hung the first step
until the timeout. Now every rank raises :class:`PipelineMismatchError` from the
constructor, naming the argument and both values, before any micro-batch moves.

The multi-rank cases give rank 0 one value and every other rank another; at one
rank there is nobody to disagree with, and they are skipped as such.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import MismatchError, allreduce, world
from mpx.pipeline import Pipeline, PipelineMismatchError
from mpx.pipeline.build_agreement import build_fields
from mpx.pipeline.schedules.table import stages_per_rank

LAYERS = 12  # splits evenly into 1-3 ranks x 1-2 chunks


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(4, 4) for _ in range(LAYERS)])


def _even(virtual: int) -> list[int]:
    return [LAYERS // virtual] * virtual


def _arguments(schedule: str, **given: Any) -> dict[str, Any]:
    """Arguments of a pipeline that builds at this world size (one value per rank given)."""
    size = world().size
    v = stages_per_rank(schedule, given.get("stages_per_rank"))
    return {"balance": _even(size * v), "chunks": 4, "schedule": schedule, **given}


def _fields(**given: Any) -> dict[str, Any]:
    return dict(
        build_fields(
            _model(),
            given.get("balance", [6, 6]),
            given.get("chunks", 4),
            given.get("schedule", "1f1b"),
            given.get("stages_per_rank"),
            given.get("pass_costs", "measured"),
            0,
            {"step_every": given.get("step_every", 1)},
        )
    )


# -- one process: what is compared ----------------------------------------------


def test_spellings_and_defaults_compare_as_what_they_mean() -> None:
    assert _fields(schedule="Interleaved1F1B") == _fields(schedule="interleaved_1f1b")
    assert _fields(schedule="zbv", stages_per_rank=None) == _fields(
        schedule="zbv", stages_per_rank=2
    )
    assert _fields(balance=[6, 6]) != _fields(balance=[5, 7])
    assert _fields(pass_costs="unit") != _fields(pass_costs="measured")
    assert _fields(step_every=2) != _fields()


def test_a_bad_value_compares_as_given() -> None:
    # Validation comes after the comparison: an unknown name must not raise here.
    assert _fields(schedule="zigzag")["schedule"] == "zigzag"
    assert _fields(chunks=0)["chunks"] == 0


def test_lists_show_as_the_lists_passed() -> None:
    assert repr(_fields(balance=[3, 9])["balance"]) == "[3, 9]"


# -- every rank: a difference raises on all of them ---------------------------------

# (case, schedule, rank 0's arguments, the other ranks'; the error's words). Only the
# named argument differs: the schedules paired place as many chunks a rank, and the
# stages_per_rank case keeps rank 0's balance (validated only after the comparison).
MISMATCHES = [
    (
        "1f1b-gpipe",
        "1f1b",
        {},
        {"schedule": "gpipe"},
        "schedule: rank 0 passed '1f1b', rank 1 'gpipe'",
    ),
    (
        "1f1b-async",
        "1f1b",
        {},
        {"schedule": "async"},
        "schedule: rank 0 passed '1f1b', rank 1 'async'",
    ),
    (
        "interleaved-looped",
        "interleaved_1f1b",
        {},
        {"schedule": "looped_bfs"},
        "schedule: rank 0 passed 'interleaved_1f1b', rank 1 'looped_bfs'",
    ),
    (
        "zbv-interleaved_zb",
        "zbv",
        {},
        {"schedule": "interleaved_zb"},
        "schedule: rank 0 passed 'zbv', rank 1 'interleaved_zb'",
    ),
    (
        "dualpipev-zbv",
        "dualpipev",
        {},
        {"schedule": "zbv"},
        "rank 0 passed 'dualpipev', rank 1 'zbv'",
    ),
    ("chunks-zbv", "zbv", {"chunks": 4}, {"chunks": 2}, "chunks: rank 0 passed 4, rank 1 2"),
    ("chunks-1f1b", "1f1b", {"chunks": 4}, {"chunks": 8}, "chunks: rank 0 passed 4, rank 1 8"),
    (
        "pass_costs",
        "interleaved_zb",
        {},
        {"pass_costs": "unit"},
        "pass_costs: rank 0 passed 'measured', rank 1 'unit'",
    ),
    (
        "stages_per_rank",
        "interleaved_1f1b",
        {},
        {"stages_per_rank": 3},
        "stages_per_rank: rank 0 passed 2, rank 1 3",
    ),
    ("async-step_every", "async", {}, {"step_every": 2}, "step_every: rank 0 passed 1, rank 1 2"),
    (
        "async-split_backward",
        "async",
        {},
        {"split_backward": True},
        "split_backward: rank 0 passed False, rank 1 True",
    ),
    # A bad value on one rank only: the mismatch on every rank, not an error there
    # and a hang elsewhere.
    ("one-rank-bad-chunks", "gpipe", {}, {"chunks": 0}, "chunks: rank 0 passed 4, rank 1 0"),
]


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("schedule", "first", "others", "words"),
    [pytest.param(s, a, b, w, id=case) for case, s, a, b, w in MISMATCHES],
)
def test_ranks_that_build_differently_all_raise(
    schedule: str, first: dict[str, Any], others: dict[str, Any], words: str
) -> None:
    comm = world()
    if comm.size == 1:
        pytest.skip("one rank has nobody to disagree with")
    mine = {**_arguments(schedule), **(first if comm.rank == 0 else others)}
    with pytest.raises(PipelineMismatchError) as info:
        Pipeline(_model(), **mine)
    assert isinstance(info.value, MismatchError)
    assert words in str(info.value)
    # The world is intact: the next collective goes through.
    assert allreduce(torch.ones(1), "sum", comm=comm).item() == comm.size


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_balance_mismatch_names_both_splits() -> None:
    """The silent case of issue 41: a balance that differs trained on with a wrong loss."""
    comm = world()
    if comm.size == 1:
        pytest.skip("one rank has nobody to disagree with")
    even = _even(comm.size)
    uneven = [even[0] - 1, *even[1:-1], even[-1] + 1]
    with pytest.raises(PipelineMismatchError) as info:
        Pipeline(_model(), balance=even if comm.rank == 0 else uneven, chunks=4, schedule="1f1b")
    assert f"balance: rank 0 passed {even}, rank 1 {uneven}" in str(info.value)


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_a_consistent_build_trains_as_before() -> None:
    """The agreement changes nothing when the ranks agree (at every size, 1 included)."""
    comm = world()
    pipe = Pipeline(_model(), balance=_even(comm.size), chunks=2, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    torch.manual_seed(1)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    loss = pipe.step(x, y, nn.functional.mse_loss, opt)
    reference = nn.functional.mse_loss(_model()(x), y).item()
    assert loss == pytest.approx(reference, rel=1e-6)
