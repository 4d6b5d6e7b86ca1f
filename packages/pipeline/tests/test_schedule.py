"""Schedules: the grids in the docstring, bubbles, memory bound, async rule."""

from __future__ import annotations

import re

import pytest

import mpx.pipeline.schedules.table as schedule_module
from mpx.pipeline import PipelineError, PipelineValueError
from mpx.pipeline.schedules import zero_bubble
from mpx.pipeline.schedules.table import (
    SCHEDULES,
    SPLIT,
    TIMED,
    Action,
    async_ops,
    bubble_fraction,
    compute_actions,
    flush_ops,
    grid,
    max_alive,
    rank_actions,
    simulate,
    stage_ops,
    timeline,
)

ONE_CHUNK = ("sequential", "gpipe", "1f1b", "async")
CHUNKED = tuple(s for s in SCHEDULES if s not in ONE_CHUNK)


def docstring_grid(name: str, rows: int) -> str:
    doc = schedule_module.__doc__ or ""
    block = doc.split(f"\n``{name}`` —", 1)[1]
    lines = re.findall(r"^    ((?:stage|rank) \d \|.*)$", block, flags=re.M)[:rows]
    return "\n".join(lines)


@pytest.mark.parametrize("name", SCHEDULES)
def test_docstring_grids_are_the_rules_output(name: str) -> None:
    if name in ONE_CHUNK:
        assert grid(name, 3, 4) == docstring_grid(name, 3)
    else:
        assert grid(name, 2, 4) == docstring_grid(name, 2)


def test_async_split_chunks_grid_is_the_layouts_output() -> None:
    assert grid("async", 2, 4, 2, split=True) == docstring_grid("async`` with ``split_backward", 2)


@pytest.mark.parametrize(
    ("p", "v", "split"), [(1, 2, True), (2, 2, True), (3, 2, False), (3, 3, True)]
)
@pytest.mark.parametrize("every", [0, 1, 3])
def test_async_layout_runs_each_pass_once_and_steps_in_order(
    p: int, v: int, split: bool, every: int
) -> None:
    """AsyncLayout over calls and a flush: every pass of every micro-batch once, the
    per-chunk rule (f − b <= depth), W before the chunk's next I, steps after the
    right W, and lists that run against the dependencies (no deadlock)."""
    from mpx.pipeline.schedules.table import AsyncLayout, timeline

    n, m, calls = p * v, 4, 3
    layout = AsyncLayout(p, v, split)
    lists: list[list[Action]] = [[] for _ in range(p)]
    for c in range(calls):
        for r, acts in enumerate(layout.call((c + 1) * m, every)):
            lists[r] += acts
        assert all(
            f == (c + 1) * m and f - b <= n - 1 - s for s, (f, b) in enumerate(layout.counts())
        )
    for r, acts in enumerate(layout.call(calls * m, every, flush=True)):
        lists[r] += acts
    assert layout.counts() == [(calls * m, calls * m)] * n
    timeline(lists)  # no deadlock across the calls
    for r, acts in enumerate(lists):
        for s in range(r, n, p):
            mine = [a for a in acts if a.stage == s]
            back = [a.kind for a in mine if a.kind not in {"F", "STEP"}]
            assert back == (["I", "W"] * calls * m if split else ["B"] * calls * m)
            f = b = 0
            for a in mine:
                if a.kind == "F":
                    assert a.mb == f
                    assert f - b <= n - 1 - s
                    f += 1
                elif a.kind in ("I", "B"):
                    assert a.mb == b
                    b += 1
            steps = [a.mb for a in mine if a.kind == "STEP"]
            total = calls * m
            expected = list(range(every, total + 1, every)) if every else []
            if every and total % every:
                expected.append(total)
            assert steps == expected


@pytest.mark.parametrize("name", CHUNKED)
@pytest.mark.parametrize(("p", "m", "v"), [(1, 2, 2), (2, 4, 2), (3, 6, 2), (2, 4, 3), (4, 8, 2)])
def test_chunked_schedules_run_each_pass_once_in_order(name: str, p: int, m: int, v: int) -> None:
    if name in ("zbv", "dualpipev"):
        v = 2
    lists = [compute_actions(name, r, p, m, v) for r in range(p)]
    simulate(lists)  # no deadlock
    for s in range(p * v):
        acts = [a for lst in lists for a in lst if a.stage == s]
        for j in range(m):
            kinds = [a.kind for a in acts if a.mb == j]
            assert kinds in (["F", "B"], ["F", "I", "W"]), (s, j, kinds)
    # Every send has its receive on the rank of the next (or previous) stage.
    sends = {
        (a.kind, a.mb, a.stage) for r in range(p) for a in rank_actions(name, r, p, m, v, lists[r])
    }
    for kind, j, s in sends:
        if kind == "SEND_F":
            assert ("RECV_F", j, s + 1) in sends
        if kind == "SEND_B":
            assert ("RECV_B", j, s - 1) in sends


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (3, 6, 2), (4, 8, 2), (2, 8, 4)])
def test_interleaved_bubble_is_megatrons(p: int, m: int, v: int) -> None:
    # (p-1)/(v·m + p-1): the bubble time is 1F1B's divided by v.
    assert bubble_fraction("interleaved_1f1b", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))
    assert bubble_fraction("looped_bfs", p, m, v) == pytest.approx((p - 1) / (v * m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 6), (4, 8)])
def test_zero_bubble_schedules_beat_1f1b(p: int, m: int) -> None:
    assert bubble_fraction("interleaved_zb", p, m) < bubble_fraction("interleaved_1f1b", p, m)
    for name in ("zbv", "dualpipev"):
        assert bubble_fraction(name, p, m) < bubble_fraction("1f1b", p, m) / 2, name
    assert "interleaved_zb" in SPLIT


def test_torch_names_and_bad_sizes() -> None:
    assert grid("Interleaved1F1B", 2, 4) == grid("interleaved_1f1b", 2, 4)
    with pytest.raises(PipelineError, match="multiple of the 3 ranks"):
        compute_actions("interleaved_1f1b", 0, 3, 4, 2)
    with pytest.raises(PipelineError, match="raise chunks to 6"):
        compute_actions("dualpipev", 0, 3, 4, 2)
    assert str(Action("F", 3, 1)) == "1F3"


def test_gpipe_grid_by_hand() -> None:
    assert grid("gpipe", 2, 2) == "stage 0 | F0 F1 .  .  B1 B0\nstage 1 | .  F0 F1 B1 B0 ."


@pytest.mark.parametrize(("p", "m"), [(2, 1), (2, 4), (3, 4), (4, 8), (5, 3)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_bubble_is_the_textbook_fraction(name: str, p: int, m: int) -> None:
    assert bubble_fraction(name, p, m) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize(("p", "m"), [(2, 4), (3, 4), (4, 8), (3, 2)])
def test_1f1b_keeps_at_most_p_minus_s_alive(p: int, m: int) -> None:
    for s in range(p):
        assert max_alive(stage_ops("1f1b", s, p, m)) == min(p - s, m)
        assert max_alive(stage_ops("gpipe", s, p, m)) == m


@pytest.mark.parametrize("name", ONE_CHUNK)
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 5), (4, 4)])
def test_every_schedule_runs_each_pass_once(name: str, p: int, m: int) -> None:
    """Within the call; ``async`` with its flush, for it owes its last backwards to the next."""
    for s in range(p):
        ops = stage_ops(name, s, p, m)
        if name == "async":
            forwards = sum(kind == "F" for kind, _ in ops)
            owed = flush_ops(forwards, len(ops) - forwards)
            assert len(owed) == min(p - s - 1, m)  # one per stage after this one
            ops += owed
        assert sorted(ops) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)])
        # A backward never precedes its own forward.
        assert all(ops.index(("F", j)) < ops.index(("B", j)) for j in range(m))


def test_async_rule_and_staleness_equal_to_depth() -> None:
    p, calls, m = 3, 5, 4
    done = [[0, 0] for _ in range(p)]
    streams: list[list[tuple[str, int]]] = [[] for _ in range(p)]
    for c in range(calls):
        for s in range(p):
            ops = async_ops(p - s - 1, done[s][0], done[s][1], (c + 1) * m)
            streams[s] += ops
            done[s][0] += sum(k == "F" for k, _ in ops)
            done[s][1] += sum(k == "B" for k, _ in ops)
    for s in range(p):
        depth = p - s - 1
        assert done[s][0] == calls * m
        assert done[s][1] == calls * m - depth
        ops = streams[s]
        # Weight version = backwards done (one step each); between F(j) and
        # B(j) exactly ``depth`` other backwards run, once past the warm-up.
        for j in range(depth, calls * m - depth):
            between = ops[ops.index(("F", j)) : ops.index(("B", j))]
            assert sum(k == "B" for k, _ in between) == depth
        assert flush_ops(*done[s]) == [("B", j) for j in range(calls * m - depth, calls * m)]
    # The concatenated calls never deadlock.
    simulate(streams)


def test_simulate_reports_a_deadlock() -> None:
    with pytest.raises(PipelineError, match="deadlock"):
        simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])


def test_bad_arguments() -> None:
    with pytest.raises(PipelineError, match="zigzag"):
        stage_ops("zigzag", 0, 2, 2)
    with pytest.raises(PipelineError, match="stage=2"):
        stage_ops("gpipe", 2, 2, 2)
    with pytest.raises(PipelineError, match="chunks=0"):
        stage_ops("gpipe", 0, 2, 0)


def _span(lists: list[list[Action]], costs: dict[str, list[float]]) -> float:
    return max(end for row in timeline(lists, costs) for _, end, _ in row)


def _uniform(n: int, f: float, i: float, w: float) -> dict[str, list[float]]:
    return {"F": [f] * n, "I": [i] * n, "W": [w] * n}


@pytest.mark.parametrize("name", TIMED)
def test_zero_bubble_laid_out_by_costs_idles_less(name: str) -> None:
    """W two thirds of an I (a transformer's, on CPU), 2 ranks, m = 8: laid out with unit
    costs the step idles 12-16 %, laid out with the real ones about 5 %."""
    p, m, n = 2, 8, 4
    costs = _uniform(n, 7.5, 7.5, 5)
    unit = [compute_actions(name, r, p, m, 2) for r in range(p)]
    timed = [compute_actions(name, r, p, m, 2, costs=costs) for r in range(p)]
    busy = m * (7.5 + 7.5 + 5) * 2  # a rank's two chunks
    idle_unit = 1 - busy / _span(unit, costs)
    idle_timed = 1 - busy / _span(timed, costs)
    assert 0.07 < idle_unit < 0.17, idle_unit
    assert idle_timed < 0.06, idle_timed
    # With the unit costs themselves the layout is the paper's (the docstring grid).
    assert [compute_actions(name, r, p, m, 2, costs=_uniform(n, 1, 1, 1)) for r in range(p)] == unit


@pytest.mark.parametrize("seed", range(40))
def test_zero_bubble_by_costs_is_valid_and_never_slower_than_unit(seed: int) -> None:
    """Random per-stage costs: each stage's F, I and W once per micro-batch and in
    micro-batch order (so the layout never changes what a step computes), lists that
    run, and a span no longer than the unit layout's under the same costs."""
    import random

    rng = random.Random(seed)
    name = TIMED[seed % 2]
    p = rng.choice([2, 3, 4])
    m = p * rng.choice([1, 2, 4])
    v = 2 if name == "zbv" else rng.choice([2, 3])
    n = p * v
    costs = {k: [float(rng.randint(1, 6)) for _ in range(n)] for k in "FIW"}
    lists = [compute_actions(name, r, p, m, v, costs=costs) for r in range(p)]
    for s in range(n):
        for kind in "FIW":
            order = [a.mb for lst in lists for a in lst if a.stage == s and a.kind == kind]
            assert order == list(range(m)), (s, kind, order)
    unit = [compute_actions(name, r, p, m, v) for r in range(p)]
    assert _span(lists, costs) <= _span(unit, costs)


def test_zero_bubble_past_the_cap_only_where_it_would_deadlock() -> None:
    """4 ranks, 16 micro-batches, W two thirds of F: the cost-driven layout fills rank 3
    with its first chunk's forwards until its cap leaves no room for the second chunk's;
    the deepest ready forward then goes past the cap, and the layout finishes."""
    p, m, n = 4, 16, 8
    costs = _uniform(n, 7.5, 7.5, 5)
    lists = zero_bubble.zero_bubble(p, m, 2, "loop", [11, 9, 7, 5], costs)
    simulate(lists)
    assert sorted(a.kind for a in lists[3]) == sorted("FIW" * m * 2)
    alive = peak = 0
    for a in lists[3]:
        alive += {"F": 1, "W": -1}.get(a.kind, 0)
        peak = max(peak, alive)
    assert peak == 6  # one past rank 3's cap of 5


def test_bad_costs_name_the_value() -> None:
    with pytest.raises(PipelineValueError, match=r"costs\['I'\]=\[1, 0\].*one positive"):
        compute_actions("zbv", 0, 1, 2, 2, costs={"F": [1, 1], "I": [1, 0], "W": [1, 1]})
    with pytest.raises(PipelineValueError, match=r"costs\['F'\]=\[1\].*2 of them"):
        compute_actions("zbv", 0, 1, 2, 2, costs={"F": [1], "I": [1, 1], "W": [1, 1]})
    # The schedules whose lists do not depend on times ignore them.
    assert compute_actions("1f1b", 0, 2, 4, costs={"F": [1]}) == compute_actions("1f1b", 0, 2, 4)
