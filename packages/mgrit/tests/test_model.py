"""The performance model's work count, by hand (see test_work.py for the algorithm's count).

N = 16 steps, 3 levels, cfactor 2, one V-cycle each way: a rank with b coarsest
intervals steps 21b rows in each solve, of which 3b are the coarsest level's
(the nested start solves it twice, the iteration once). On the critical path
the coarsest level is serial: all 4 of its steps, 3 times, whatever rank holds
them: 21b + 3 (4 - b). The busiest rank holds b = 4 (1 rank) or 2 (2, 3 ranks).
"""

from __future__ import annotations

import pytest

from mpx.mgrit import MGRITConfigError
from mpx.mgrit.model import Costs, count, predict


@pytest.mark.parametrize(("size", "b"), [(1, 4), (2, 2), (3, 2)])
def test_critical_path_work_by_hand(size: int, b: int) -> None:
    work = count(16, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, size=size)
    for kind in ("forward", "adjoint"):
        assert work.rows[kind] + work.singles[kind] == 21 * b + 3 * (4 - b), (kind, work)
        assert work.singles[kind] >= 3 * 4  # the coarsest steps, one call each
    assert work.rows["linearize"] == work.rows["gradient"] == work.owned == 4 * b


def test_issue_config_at_one_rank() -> None:
    # 256 steps, cfactor 4, 3 levels: n0, n1, n2 = 256, 64, 16; nested start 16 + 48 + 16 +
    # 16 + 16 + 48 = 160, the iteration 192 + 64 + 64 + 144 + 192 = 656, the residual 64.
    work = count(256, levels=3, cfactor=4, fwd_iters=1, bwd_iters=1, size=1)
    assert work.rows["forward"] + work.singles["forward"] == 880
    assert work.singles["forward"] == 3 * 16
    assert work.messages == 0  # one rank: no neighbour


def test_predict_prices_rows_singles_and_messages() -> None:
    work = count(16, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, size=1)
    row = dict.fromkeys(work.rows, 1.0)
    zero = dict.fromkeys(work.rows, 0.0)
    assert predict(work, Costs(row, zero, message=0.0)) == sum(work.rows.values())
    assert predict(work, Costs(zero, row, message=0.0)) == sum(work.singles.values())
    assert predict(work, Costs(zero, zero, message=1.0)) == work.messages
    # Ranks beyond the cores share them.
    assert predict(work, Costs(row, zero, 0.0, cores=2), size=4) == 2 * sum(work.rows.values())


def test_bad_grid_is_refused() -> None:
    with pytest.raises(MGRITConfigError, match="multiple of 16"):
        count(20, levels=3, cfactor=4, fwd_iters=1, bwd_iters=1, size=1)
