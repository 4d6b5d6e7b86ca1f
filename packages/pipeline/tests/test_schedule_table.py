"""The schedule table, actions as text (torch's ``2F0``), and the grid of a failed call."""

from __future__ import annotations

import pytest

from mpx.pipeline import PipelineValueError
from mpx.pipeline.schedules.table import (
    ALIASES,
    SCHEDULES,
    SPLIT,
    TABLE,
    TIMED,
    Action,
    AsyncLayout,
    Schedule,
    async_actions,
    async_flush_actions,
    compute_actions,
    format_actions,
    parse_actions,
    placement,
    rank_actions,
    spec,
    stages_per_rank,
)
from mpx.pipeline.schedules.timing import stopped_grid

SIZES = [(1, 2), (2, 4), (3, 6), (4, 8)]  # (ranks, micro-batches)


def test_each_schedule_is_declared_once_and_the_names_come_from_the_table() -> None:
    names = [s.name for s in TABLE]
    assert len(set(names)) == len(names)
    # The values the package documented before the table (README, Pipeline's docstring).
    assert SCHEDULES == (
        "sequential",
        "gpipe",
        "1f1b",
        "async",
        "interleaved_1f1b",
        "looped_bfs",
        "interleaved_zb",
        "zbv",
        "dualpipev",
    )
    assert ALIASES == {
        "GPipe": "gpipe",
        "1F1B": "1f1b",
        "Interleaved1F1B": "interleaved_1f1b",
        "LoopedBFS": "looped_bfs",
        "InterleavedZeroBubble": "interleaved_zb",
        "ZBVZeroBubble": "zbv",
        "DualPipeV": "dualpipev",
    }
    assert SPLIT == ("interleaved_zb", "zbv", "dualpipev")
    assert TIMED == ("interleaved_zb", "zbv")
    assert [s.name for s in TABLE if s.stream] == ["async"]
    assert [s.name for s in TABLE if s.placement == "v"] == ["zbv", "dualpipev"]
    for torch_name, name in ALIASES.items():
        assert spec(torch_name) is spec(name)
        assert placement(torch_name) == spec(name).placement


@pytest.mark.parametrize("entry", TABLE, ids=lambda s: s.name)
def test_the_chunk_rule_is_what_stages_per_rank_accepts(entry: Schedule) -> None:
    rule = entry.chunks
    assert stages_per_rank(entry.name, None) == rule.default
    for v in range(1, 5):
        allowed = v >= rule.least and (rule.most is None or v <= rule.most)
        if allowed:
            assert stages_per_rank(entry.name, v) == v
        else:
            with pytest.raises(PipelineValueError, match=f"stages_per_rank={v}"):
                stages_per_rank(entry.name, v)


def test_an_action_prints_as_torch_does_and_parses_back() -> None:
    assert str(Action("F", 0, 2)) == "2F0"
    assert str(Action("SEND_B", 3, 1)) == "1SEND_B3"
    assert Action.parse("2F0") == Action("F", 0, 2)
    assert Action.parse("1SEND_B3") == Action("SEND_B", 3, 1)
    assert Action.parse("12RECV_F10") == Action("RECV_F", 10, 12)
    assert Action.parse("-1STEP4") == Action("STEP", 4, -1)


@pytest.mark.parametrize("text", ["", "F0", "2X0", "2F", "2 F0", "a2F0", "2SEND0"])
def test_text_that_is_not_an_action_is_named_in_the_error(text: str) -> None:
    with pytest.raises(PipelineValueError, match="is not <stage><kind><micro-batch>") as info:
        Action.parse(text)
    assert repr(text.strip()) in str(info.value)


def test_lists_are_written_as_text() -> None:
    """Expected lists as torch writes them: 1F1B on two ranks, three micro-batches."""
    assert format_actions(rank_actions("1f1b", 0, 2, 3)) == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0F2 0SEND_F2 0RECV_B1 0B1 0RECV_B2 0B2"
    )
    assert rank_actions("1f1b", 1, 2, 3) == parse_actions(
        "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1 1RECV_F2 1F2 1B2 1SEND_B2"
    )
    with pytest.raises(PipelineValueError, match="'0Z1'"):
        parse_actions("0F0 0Z1")


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize(("p", "m"), SIZES)
def test_every_schedules_lists_round_trip_through_text(name: str, p: int, m: int) -> None:
    v = stages_per_rank(name, None)
    for r in range(p):
        for actions in (compute_actions(name, r, p, m, v), rank_actions(name, r, p, m, v)):
            assert actions
            assert parse_actions(format_actions(actions)) == actions


@pytest.mark.parametrize(("p", "v", "split"), [(1, 1, False), (3, 1, True), (2, 2, True)])
def test_the_async_streams_lists_round_trip_with_their_steps(p: int, v: int, split: bool) -> None:
    lists: list[list[Action]] = []
    if v == 1:
        for r in range(p):
            lists.append(async_actions(p - r - 1, 0, 0, 4, r, step_every=3, split=split))
            lists.append(async_flush_actions(4, 4 - (p - r - 1), r, step_every=3, split=split))
    else:
        layout = AsyncLayout(p, v, split)
        lists += layout.call(4, step_every=1) + layout.call(4, step_every=3, flush=True)
    steps = [a for actions in lists for a in actions if a.kind == "STEP"]
    assert steps
    for actions in lists:
        assert parse_actions(format_actions(actions)) == actions


@pytest.mark.parametrize(
    ("name", "p", "m", "rank", "failed", "rows"),
    [
        pytest.param(
            "1f1b",
            3,
            4,
            1,
            Action("B", 0, 1),
            [
                "stage 0 | F0 F1 F2 .  .  B0 F3 B1 .  B2 .  B3",
                "stage 1 | .  F0 F1 .  B0 F2 B1 F3 B2 .  B3 .",
                "                      ^^ rank 1 stopped here (1B0)",
                "stage 2 | .  .  F0 B0 F1 B1 F2 B2 F3 B3 .  .",
            ],
            id="marks-where-the-rank-stopped",
        ),
        pytest.param(
            "gpipe",
            2,
            12,
            0,
            Action("B", 11, 0),
            [
                "(from step 6)",
                "stage 0 | F6  F7  F8  F9  F10 F11 .   .   B11 B10 B9  B8  B7  B6  B5  B4  B3 ...",
                "                                          ^^^ rank 0 stopped here (0B11)",
                "stage 1 | F5  F6  F7  F8  F9  F10 F11 B11 B10 B9  B8  B7  B6  B5  B4  B3  B2 ...",
            ],
            id="keeps-to-the-steps-near-the-failure",
        ),
    ],
)
def test_the_grid_of_a_failed_call(
    name: str, p: int, m: int, rank: int, failed: Action, rows: list[str]
) -> None:
    lists = [compute_actions(name, r, p, m) for r in range(p)]
    assert stopped_grid(lists, rank, failed, p, 1, "loop", m) == "\n".join(rows)


def test_the_grid_of_a_failed_call_without_the_other_ranks_lists_is_one_row() -> None:
    # The asynchronous stream's lists of other ranks are not known here: one row, in order.
    mine = compute_actions("zbv", 1, 2, 4)
    assert stopped_grid([mine], 1, Action("I", 0, 2), 2, 2, "v", 4, timed=False) == "\n".join(
        [
            "rank 1 | F0 f0 F1 f1 i0 I0 w0 i1 I1 F2 W0 f2 w1 ...",
            "                     ^^ rank 1 stopped here (2I0)",
        ]
    )
