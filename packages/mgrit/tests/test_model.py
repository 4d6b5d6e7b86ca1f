"""The performance model: its work by hand at one rank, its replay against the solver's
own rows on every rank (1-3 ranks), and the critical path's properties at many ranks.

N = 16 steps, 3 levels, cfactor 2, one V-cycle each way: one rank steps 21 * 4
rows in each solve (see test_work.py for the algorithm's count).
"""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import world
from mpx.mgrit import MGRIT, WORK_KINDS, MGRITConfigError
from mpx.mgrit.model import Costs, count, predict
from mpx.mgrit.solver import coarsening_factors


def test_one_rank_work_by_hand() -> None:
    work = count(16, levels=3, cfactor=2, fwd_iters=1, bwd_iters=1, size=1)
    for kind in ("forward", "adjoint"):
        assert work.rows[kind] + work.singles[kind] == 21 * 4, (kind, work)
        assert work.singles[kind] >= 3 * 4  # the coarsest steps, one call each
    assert work.rows["linearize"] == work.rows["gradient"] == work.owned == 16


@pytest.mark.mpi
@pytest.mark.parametrize("relax", ["F", "FCF"])
@pytest.mark.parametrize(("nt", "levels", "cfactor"), [(64, 4, 4), (64, 6, 2), (96, 3, 4)])
def test_the_replay_steps_the_rows_the_solver_steps_on_every_rank(
    nt: int, levels: int, cfactor: int, relax: str
) -> None:
    # The model replays the solver rank by rank: each rank's own rows in the replay
    # (private: the per-rank count is not part of the model's API) equal the rows the
    # solver stepped on that rank, for the even split and for blocks of one step.
    from mpx.mgrit.model import _KINDS, _levels, _Path, _Solve

    comm = world()
    rows = [0]

    def step(u: torch.Tensor, t: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        rows[0] += u.shape[0]
        return u / (1 + dt.view(-1, 1))

    for blocks in (None, [1] * (comm.size - 1) + [nt - comm.size + 1]):
        rows[0] = 0
        solver = MGRIT(step, 0, 1, nt, comm=comm, levels=levels, cfactor=cfactor, max_iters=2,
                       tol=0.0, vectorized=True, relax=relax, blocks=blocks)  # fmt: skip
        solver.solve(torch.ones(2, dtype=torch.float64))
        costs = Costs(dict.fromkeys(_KINDS, 1.0), dict.fromkeys(_KINDS, 1.5), 0.5)
        grid = _levels(solver.layout.blocks, coarsening_factors(cfactor, levels))
        replay = _Solve(grid, [_Path() for _ in range(comm.size)], "forward",
                        int(relax == "FCF"), costs)  # fmt: skip
        replay.run(2)
        assert replay.done[comm.rank] == rows[0], (blocks, replay.done, rows[0])


def test_the_critical_path_holds_the_busiest_ranks_work() -> None:
    free = Costs(dict.fromkeys(WORK_KINDS, 1.0), dict.fromkeys(WORK_KINDS, 1.0), message=0.0)
    for size in (2, 3, 16, 64):
        work = count(256, levels=4, cfactor=4, fwd_iters=1, bwd_iters=1, size=size, costs=free)
        busiest = count(256, levels=4, cfactor=4, fwd_iters=1, bwd_iters=1, size=1, costs=free)
        on_path = sum(work.rows.values()) + sum(work.singles.values())
        assert on_path <= sum(busiest.rows.values()) + sum(busiest.singles.values())
        assert work.owned == -(-(256 // 4) // size) * 4
        assert on_path >= 2 * work.owned  # its own linearisation and gradients at least


def test_ranks_beyond_the_coarsest_intervals_help_on_the_fine_layout_only() -> None:
    row = dict.fromkeys(WORK_KINDS, 100e-6)
    costs = Costs(row, dict.fromkeys(WORK_KINDS, 150e-6), message=50e-6, per_step=100e-6)

    def seconds(size: int, layout: str) -> float:
        work = count(1024, 4, 4, 2, 1, size, layout=layout, costs=costs)
        return predict(work, costs, size)

    # 4 levels of cfactor 4: 16 coarsest intervals.
    assert seconds(64, "coarsest") == pytest.approx(seconds(16, "coarsest"), rel=0.02)
    assert seconds(64, "fine") < 0.6 * seconds(16, "fine")
    assert seconds(16, "fine") == pytest.approx(seconds(16, "coarsest"), rel=0.02)
    with pytest.raises(MGRITConfigError, match="layout must be one of"):
        count(64, 2, 2, 1, 1, 2, layout="coarse")


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
