"""MGRIT against PyMGRIT (the independent reference) and against itself on any rank count.

The mpi tests are size-agnostic: each rank also solves the same problem alone
(on COMM_SELF); the distributed history must equal the single-rank one exactly,
and both must equal PyMGRIT's to 4 significant digits.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import numpy as np
import pytest
import torch
from mpi4py import MPI

from mpx.collectives import Communicator, MismatchError, world
from mpx.mgrit import MGRIT, MGRITConfigError, MGRITError, MGRITTypeError
from mpx.mgrit.solver import Layout

# PyMGRIT 1.0.6 calls np.in1d, which numpy 2.4 removed.
if not hasattr(np, "in1d"):
    np.in1d = np.isin  # type: ignore[attr-defined]


@functools.cache
def self_comm() -> Communicator:
    return Communicator.from_mpi(MPI.COMM_SELF)


def dahlquist(u: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
    """Backward Euler for u' = -u, written as PyMGRIT's Dahlquist example writes it."""
    if isinstance(dt, torch.Tensor) and dt.dim() < u.dim():  # vectorized: one dt per row
        dt = dt.reshape(dt.shape + (1,) * (u.dim() - dt.dim()))
    z = dt * -1
    u_next: torch.Tensor = 1 / (1 - z) * u  # t, dt: floats, or tensors when vectorized
    return u_next


def pymgrit_dahlquist(
    nt: int, levels: int, cfactor: int, nested: bool, cycle_type: str = "V"
) -> np.ndarray:
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.core.simple_setup_problem import simple_setup_problem
    from pymgrit.dahlquist.dahlquist import Dahlquist

    problem = simple_setup_problem(
        problem=Dahlquist(t_start=0, t_stop=5, nt=nt + 1), level=levels, coarsening=cfactor
    )
    solver = Mgrit(
        problem=problem,
        tol=1e-10,
        max_iter=20,
        nested_iteration=nested,
        cycle_type=cycle_type,
        comm_time=MPI.COMM_SELF,
        logging_lvl=30,
    )
    return np.asarray(solver.solve()["conv"])


def on_rank0(fn: Any, *args: Any) -> Any:
    """Runs the (serial) reference once and shares its answer."""
    comm = world()
    value = fn(*args) if comm.rank == 0 else None
    return comm.mpi.bcast(value, root=0)


# -- unit tests -----------------------------------------------------------------


def test_layout_splits_the_fine_grid_into_blocks() -> None:
    lay = Layout(0.0, 5.0, nt=100, levels=2, cfactor=2, size=3, rank=1)
    assert lay.blocks == [34, 34, 32]  # whole fine C-intervals of 2 steps
    assert (lay.levels[0].first, lay.levels[0].count) == (34, 34)
    assert (lay.levels[1].first, lay.levels[1].count) == (17, 17)
    assert (lay.left, lay.right) == (0, 2)
    assert list(lay.fine_indices()) == list(range(35, 69))
    np.testing.assert_array_equal(lay.levels[1].times, np.linspace(0, 5, 101)[::2][17:35])


def test_every_rank_holds_fine_points_beyond_the_coarsest_intervals() -> None:
    # 64 steps, 4 levels of cfactor 4: one coarsest interval, yet 3 ranks share the work.
    lays = [Layout(0.0, 1.0, nt=64, levels=4, cfactor=4, size=3, rank=r) for r in range(3)]
    assert [lay.blocks for lay in lays] == [[24, 20, 20]] * 3
    assert [lay.levels[0].count for lay in lays] == [24, 20, 20]
    # Level 1 (16 points): the coarse points inside each fine block.
    assert [(lay.levels[1].first, lay.levels[1].count) for lay in lays] == [(0, 6), (6, 5), (11, 5)]
    # Level 2 (4 points): rank 1 owns point 2 (fine 32), rank 2 points 3, 4.
    assert [(lay.levels[2].first, lay.levels[2].count) for lay in lays] == [(0, 1), (1, 1), (2, 2)]
    # The coarsest level (1 interval): only rank 2 owns a point, its ghost is t0.
    assert [lay.levels[3].count for lay in lays] == [0, 0, 1]
    assert (lays[2].levels[3].left, lays[0].levels[3].right) == (None, None)
    # Row 0 of rank 1 on level 1 is point 6, an F-point (cfactor 4): its first C-point is row 2.
    lv = lays[1].levels[1]
    assert (lv.first_c, lv.c_count, lv.ends_on_c) == (2, 1, False)
    assert lays[2].levels[1].ends_on_c
    assert lays[0].c_counts(0) == [6, 5, 5]
    assert [(lay.levels[2].left, lay.levels[2].right) for lay in lays] == [
        (None, 1),
        (0, 2),
        (1, None),
    ]


def test_layout_leaves_ranks_without_points_out() -> None:
    # Explicit blocks (the adjoint's reversed layout): the first holder owns t0.
    lays = [
        Layout(0.0, 1.0, nt=6, levels=2, cfactor=2, size=3, rank=r, blocks=[0, 4, 2])
        for r in range(3)
    ]
    assert not lays[0].active
    assert [lay.holds_start for lay in lays] == [False, True, False]
    assert list(lays[1].fine_indices()) == [0, 1, 2, 3, 4]
    assert list(lays[2].fine_indices()) == [5, 6]
    assert (lays[1].left, lays[1].right, lays[2].left) == (None, 2, 1)
    assert lays[0].last_rank == 2
    for bad in ([2, 2, 0], [2, 2, 2, 1], [-2, 4, 4]):
        with pytest.raises(MGRITConfigError, match=re.escape(f"blocks={bad}")):
            Layout(0.0, 1.0, nt=6, levels=2, cfactor=2, size=3, rank=0, blocks=bad)


def splits(nt: int, size: int) -> dict[str, list[int] | None]:
    """Fine blocks of every kind a layout must handle, for ``size`` ranks."""
    rng = np.random.default_rng(nt + size)
    cuts = np.sort(rng.integers(0, nt + 1, size - 1))
    return {
        "even": None,
        # Boundaries inside fine C-intervals, ranks of one step, empty ranks.
        "one step each then the rest": [1] * (size - 1) + [nt - size + 1],
        "random": np.diff(np.concatenate([[0], cuts, [nt]])).astype(int).tolist(),
        "all on the last": [0] * (size - 1) + [nt],
    }


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("nt", "levels", "cfactor"),
    [(64, 4, 4), (64, 6, 2), (96, 3, [4, 3]), (128, 4, 2), (64, 2, 8)],
)
@pytest.mark.parametrize(("relax", "cycle_type", "nested"), [("F", "V", True), ("FCF", "F", False)])
@pytest.mark.parametrize("boundary_steps", [False, True])
@pytest.mark.parametrize("vectorized", [False, True])
def test_any_split_gives_the_single_rank_history(
    nt: int,
    levels: int,
    cfactor: int | list[int],
    relax: str,
    cycle_type: str,
    nested: bool,
    boundary_steps: bool,
    vectorized: bool,
) -> None:
    # Ranks beyond the coarsest intervals, intervals that cross ranks on every level:
    # the history and the solution are the single rank's, exactly.
    kwargs: dict[str, Any] = {"levels": levels, "cfactor": cfactor, "relax": relax,
                              "cycle_type": cycle_type, "skip_downcycle": nested,
                              "max_iters": 6, "tol": 0.0}  # fmt: skip
    alone = MGRIT(dahlquist, 0, 5, nt, comm=self_comm(), **kwargs)
    alone.solve(torch.ones((), dtype=torch.float64))
    for name, blocks in splits(nt, world().size).items():
        s = MGRIT(dahlquist, 0, 5, nt, comm=world(), blocks=blocks, vectorized=vectorized,
                  boundary_steps=boundary_steps, **kwargs)  # fmt: skip
        final = s.solve(torch.ones((), dtype=torch.float64))
        assert s.residuals == alone.residuals, name
        assert torch.equal(final, alone.local_solution()[-1]), name
        idx = list(s.local_indices())
        assert torch.equal(s.local_solution(), alone.local_solution()[idx]), name


@pytest.mark.mpi
@pytest.mark.parametrize(("nt", "levels", "cfactor"), [(64, 4, 4), (64, 6, 2)])
def test_boundary_steps_keep_every_step_on_its_block(nt: int, levels: int, cfactor: int) -> None:
    # A network's step k is layer k: with boundary_steps a rank only steps from points
    # of its fine block or its last point (the next block's first layer); without, its
    # coarse row 0 may lie far left of its block.
    comm, dt = world(), 5.0 / nt
    outside: dict[bool, int] = {}
    for boundary_steps in (False, True):
        for blocks in splits(nt, comm.size).values():
            starts: list[int] = []

            def step(u: torch.Tensor, t: Any, h: Any, starts: list[int] = starts) -> torch.Tensor:
                ts = t.tolist() if isinstance(t, torch.Tensor) else [t]
                starts.extend(round(x / dt) for x in ts)
                return dahlquist(u, t, h)

            s = MGRIT(step, 0, 5, nt, comm=comm, blocks=blocks, levels=levels, cfactor=cfactor,
                      vectorized=True, boundary_steps=boundary_steps, max_iters=2)  # fmt: skip
            s.solve(torch.ones((), dtype=torch.float64))
            lo, hi = s.layout.starts[comm.rank], s.layout.starts[comm.rank + 1]
            bad = [k for k in starts if not lo <= k <= hi]
            outside[boundary_steps] = outside.get(boundary_steps, 0) + len(bad)
    every = comm.mpi.allgather(outside)
    assert all(o[True] == 0 for o in every), every
    if comm.size > 2:  # the random and even splits put coarse row 0s left of blocks
        assert any(o[False] > 0 for o in every), every


@pytest.mark.mpi
def test_ranks_with_other_grids_raise_on_every_rank() -> None:
    # Every rank but the last puts its steps elsewhere: caught when the solver is made.
    comm = world()
    blocks = [64] + [0] * (comm.size - 1)
    if comm.rank == comm.size - 1 and comm.size > 1:
        blocks = [0] * (comm.size - 1) + [64]
    if comm.size == 1:
        MGRIT(dahlquist, 0, 5, 64, levels=3, comm=comm, blocks=blocks)  # nothing to disagree
        return
    with pytest.raises(MismatchError, match="MGRIT: ranks disagree on blocks"):
        MGRIT(dahlquist, 0, 5, 64, levels=3, comm=comm, blocks=blocks)


@pytest.mark.mpi
def test_blocks_with_empty_ranks_give_the_same_history() -> None:
    # All time steps on the last rank: the ranks before it hold nothing.
    size = world().size
    alone = MGRIT(dahlquist, 0, 5, 64, levels=3, comm=self_comm())
    alone.solve(torch.ones((), dtype=torch.float64))
    blocks = [0] * (size - 1) + [64]
    s = MGRIT(dahlquist, 0, 5, 64, levels=3, comm=world(), blocks=blocks)
    final = s.solve(torch.ones((), dtype=torch.float64))
    assert s.residuals == alone.residuals
    assert torch.equal(final, alone.local_solution()[-1])
    assert s.layout.holds_start == (world().rank == size - 1)


@pytest.mark.mpi
def test_a_raw_mpi4py_communicator_gives_the_same_history() -> None:
    raw = MGRIT(dahlquist, 0, 5, 64, levels=3, comm=MPI.COMM_WORLD)
    wrapped = MGRIT(dahlquist, 0, 5, 64, levels=3, comm=world())
    u0 = torch.ones((), dtype=torch.float64)
    assert torch.equal(raw.solve(u0), wrapped.solve(u0))
    assert raw.residuals == wrapped.residuals
    assert raw.comm.size == world().size


def test_a_comm_of_another_kind_is_a_type_error() -> None:
    with pytest.raises(MGRITTypeError, match=r"comm must be .* mpi4py .* got int"):
        MGRIT(dahlquist, 0, 5, 64, comm=3)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"nt": 100, "levels": 4}, ["nt=100", "2*2*2=8", "levels <= 3"]),
        ({"nt": 8, "levels": 5}, ["nt=8", "16", "levels <= 4"]),
        ({"nt": 64, "cfactor": 1}, ["cfactor=1", ">= 2"]),
        ({"nt": 64, "levels": 3, "cfactor": [2]}, ["cfactor=[2]", "levels=3"]),
        ({"nt": 0}, ["nt", "0"]),
        ({"nt": 64, "levels": 0}, ["levels", "0"]),
        ({"nt": 64, "relax": "FC"}, ["relax", "'FC'"]),
        ({"nt": 64, "max_iters": 0}, ["max_iters", "0"]),
        ({"nt": 64, "fine_relax": "CF"}, ["fine_relax", "'CF'", '"FCF"']),
        ({"nt": 64, "cycle_type": "W"}, ["cycle_type", "'W'", '"F"']),
        ({"nt": 64, "tol": -1.0}, ["tol=-1.0", ">= 0"]),
        ({"nt": 64, "tol": "1e-9"}, ["tol='1e-9'", "number"]),
    ],
)
def test_bad_input_names_the_value_and_the_fix(kwargs: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(MGRITConfigError) as info:
        MGRIT(dahlquist, 0.0, 1.0, comm=self_comm(), **kwargs)
    assert isinstance(info.value, (MGRITError, ValueError))
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def serial_dahlquist(nt: int) -> torch.Tensor:
    t = np.linspace(0, 5, nt + 1)
    u = torch.ones((), dtype=torch.float64)
    out = [u]
    for i in range(nt):
        u = dahlquist(u, float(t[i]), float(t[i + 1] - t[i]))
        out.append(u)
    return torch.stack(out)


def test_one_level_is_the_sequential_solve() -> None:
    solver = MGRIT(dahlquist, 0.0, 5.0, nt=50, levels=1, comm=self_comm())
    final = solver.solve(torch.ones((), dtype=torch.float64))
    ref = serial_dahlquist(50)
    assert torch.equal(solver.local_solution(), ref)
    assert torch.equal(final, ref[-1])
    assert solver.iterations == 1
    assert solver.residuals == [0.0]


@pytest.mark.parametrize("relax", ["F", "FCF"])
def test_converges_to_the_sequential_solution(relax: str) -> None:
    solver = MGRIT(
        dahlquist, 0.0, 5.0, nt=96, levels=3, cfactor=[4, 3], relax=relax, max_iters=30,
        tol=1e-13, comm=self_comm(),
    )  # fmt: skip
    solver.solve(torch.ones((), dtype=torch.float64))
    assert solver.residuals[-1] < 1e-13
    assert all(b < a for a, b in zip(solver.residuals, solver.residuals[1:], strict=False))
    torch.testing.assert_close(solver.local_solution(), serial_dahlquist(96), rtol=0, atol=1e-12)


def test_fcf_needs_fewer_iterations_than_f() -> None:
    counts = {}
    for relax in ("F", "FCF"):
        s = MGRIT(dahlquist, 0, 5, nt=256, levels=3, cfactor=4, relax=relax, max_iters=50,
                  tol=1e-12, comm=self_comm())  # fmt: skip
        s.solve(torch.ones((), dtype=torch.float64))
        counts[relax] = s.iterations
    assert counts["FCF"] < counts["F"]


def fine_step_counter(nt: int) -> tuple[Any, list[int]]:
    """Dahlquist's step, counting the calls with the fine step size (the fine level's work)."""
    fine_dt, calls = 5.0 / nt, [0]

    def step(u: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
        calls[0] += math.isclose(dt, fine_dt)
        return dahlquist(u, t, dt)

    return step, calls


def test_fine_relax_changes_the_fine_level_only() -> None:
    u0 = torch.ones((), dtype=torch.float64)
    runs: dict[tuple[str, str | None], tuple[list[float], int]] = {}
    for relax, fine in [("F", None), ("FCF", None), ("FCF", "F"), ("F", "FCF")]:
        step, calls = fine_step_counter(96)
        s = MGRIT(step, 0, 5, 96, levels=3, cfactor=[4, 3], relax=relax, fine_relax=fine,
                  max_iters=3, tol=0.0, comm=self_comm())  # fmt: skip
        s.solve(u0)
        runs[relax, fine] = (s.residuals, calls[0])
    # The same fine-level work as the uniform relaxation of the same fine kind ...
    assert runs["FCF", "F"][1] == runs["F", None][1]
    assert runs["F", "FCF"][1] == runs["FCF", None][1]
    assert runs["F", None][1] < runs["FCF", None][1]
    # ... but the coarse level relaxes differently, so every history is its own.
    histories = [tuple(h) for h, _ in runs.values()]
    assert len(set(histories)) == 4, histories


def test_fine_relax_on_two_levels_is_the_uniform_relaxation() -> None:
    # With two levels the only coarse level is the coarsest (solved, not relaxed).
    u0 = torch.ones((), dtype=torch.float64)
    for relax, fine in [("FCF", "F"), ("F", "FCF")]:
        mixed = MGRIT(dahlquist, 0, 5, 64, relax=relax, fine_relax=fine, comm=self_comm())
        mixed.solve(u0)
        uniform = MGRIT(dahlquist, 0, 5, 64, relax=fine, comm=self_comm())
        uniform.solve(u0)
        assert mixed.residuals == uniform.residuals


@pytest.mark.parametrize(("relax", "fine"), [("FCF", "F"), ("F", "FCF")])
def test_mixed_relaxation_converges_to_the_sequential_solution(relax: str, fine: str) -> None:
    solver = MGRIT(dahlquist, 0.0, 5.0, nt=96, levels=3, cfactor=[4, 3], relax=relax,
                   fine_relax=fine, max_iters=40, tol=1e-13, comm=self_comm())  # fmt: skip
    solver.solve(torch.ones((), dtype=torch.float64))
    assert solver.residuals[-1] < 1e-13
    torch.testing.assert_close(solver.local_solution(), serial_dahlquist(96), rtol=0, atol=1e-12)


def test_vectorized_step_gives_the_same_history_and_solution() -> None:
    def decay(u: torch.Tensor, t: Any, dt: Any) -> torch.Tensor:
        # A 3-component state with a time-dependent rate; dt, t broadcast over the batch.
        if isinstance(dt, torch.Tensor):
            dt, t = dt.view(-1, 1), t.view(-1, 1)
        rate = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
        u_next: torch.Tensor = u / (1 + dt * rate * (1 + 0.1 * np.cos(1.0) * t))
        return u_next

    runs = []
    for vec, floats in ((False, False), (True, False), (True, True)):
        s = MGRIT(decay, 0, 2, nt=64, levels=3, cfactor=2, comm=self_comm(), vectorized=vec,
                  float_times=floats)  # fmt: skip
        s.solve(torch.ones(3, dtype=torch.float64))
        runs.append((s.residuals, s.local_solution()))
    for other in runs[1:]:
        assert runs[0][0] == other[0]
        assert torch.equal(runs[0][1], other[1])


# -- against PyMGRIT, on any number of ranks -------------------------------------


DAHLQUIST_CASES = [
    (100, 2, 2, True),  # PyMGRIT's example: 7.19e-5 -> 3.98e-12 in 5 iterations
    (100, 2, 2, False),
    (100, 3, 2, True),
    (128, 4, 2, True),
    (128, 4, 2, False),
    (144, 3, 3, True),
]


@pytest.mark.mpi
@pytest.mark.parametrize(("nt", "levels", "cfactor", "nested"), DAHLQUIST_CASES)
@pytest.mark.parametrize("vectorized", [False, True])
def test_dahlquist_history_equals_pymgrit(
    nt: int, levels: int, cfactor: int, nested: bool, vectorized: bool
) -> None:
    ref = on_rank0(pymgrit_dahlquist, nt, levels, cfactor, nested)
    histories = []
    for comm in (world(), self_comm()):
        s = MGRIT(dahlquist, 0, 5, nt, comm=comm, levels=levels, cfactor=cfactor, tol=1e-10,
                  max_iters=20, skip_downcycle=nested, vectorized=vectorized)  # fmt: skip
        final = s.solve(torch.ones((), dtype=torch.float64))
        histories.append(s.residuals)
        torch.testing.assert_close(final, serial_dahlquist(nt)[-1], rtol=0, atol=1e-9)
    assert histories[0] == histories[1]  # identical for any number of ranks
    np.testing.assert_allclose(histories[0], ref, rtol=1e-4)
    if (nt, levels, cfactor, nested) == (100, 2, 2, True):
        assert len(ref) == 5
        assert f"{ref[0]:.2e}" == "7.19e-05"
        assert f"{ref[-1]:.2e}" == "3.98e-12"


# F-cycles differ from V-cycles from 3 levels on (with 2 the coarse level is the coarsest).
F_CYCLE_CASES = [
    (100, 3, 2, True),
    (128, 4, 2, True),
    (128, 4, 2, False),
    (144, 3, 3, True),
    (256, 5, 2, False),
]


@pytest.mark.mpi
@pytest.mark.parametrize(("nt", "levels", "cfactor", "nested"), F_CYCLE_CASES)
def test_dahlquist_f_cycle_history_equals_pymgrit(
    nt: int, levels: int, cfactor: int, nested: bool
) -> None:
    ref_f = on_rank0(pymgrit_dahlquist, nt, levels, cfactor, nested, "F")
    ref_v = on_rank0(pymgrit_dahlquist, nt, levels, cfactor, nested, "V")
    histories = {}
    for cycle_type in ("V", "F"):
        for comm in (world(), self_comm()):
            s = MGRIT(dahlquist, 0, 5, nt, comm=comm, levels=levels, cfactor=cfactor, tol=1e-10,
                      max_iters=20, skip_downcycle=nested, cycle_type=cycle_type)  # fmt: skip
            final = s.solve(torch.ones((), dtype=torch.float64))
            torch.testing.assert_close(final, serial_dahlquist(nt)[-1], rtol=0, atol=1e-9)
            histories[cycle_type, comm.size] = s.residuals
        # Identical for any number of ranks.
        assert histories[cycle_type, world().size] == histories[cycle_type, 1]
    np.testing.assert_allclose(histories["F", 1], ref_f, rtol=1e-4)
    np.testing.assert_allclose(histories["V", 1], ref_v, rtol=1e-4)
    # A real F-cycle: its own history, and fewer iterations than the V-cycle.
    assert len(ref_f) < len(ref_v)
    assert len(histories["F", 1]) < len(histories["V", 1])


def test_f_cycle_on_two_levels_is_the_v_cycle() -> None:
    runs = []
    for cycle_type in ("V", "F"):
        s = MGRIT(dahlquist, 0, 5, 64, levels=2, cycle_type=cycle_type, comm=self_comm())
        runs.append((s.solve(torch.ones((), dtype=torch.float64)), s.residuals))
    assert torch.equal(runs[0][0], runs[1][0])
    assert runs[0][1] == runs[1][1]


@pytest.mark.mpi
def test_distributed_solution_equals_single_rank() -> None:
    comm = world()
    dist = MGRIT(dahlquist, 0, 5, 128, comm=comm, levels=3, cfactor=4, max_iters=3)
    alone = MGRIT(dahlquist, 0, 5, 128, comm=self_comm(), levels=3, cfactor=4, max_iters=3)
    f_dist = dist.solve(torch.ones((), dtype=torch.float64))
    f_alone = alone.solve(torch.ones((), dtype=torch.float64))
    assert torch.equal(f_dist, f_alone)
    idx = list(dist.local_indices())
    assert torch.equal(dist.local_solution(), alone.local_solution()[idx])
    np.testing.assert_array_equal(dist.local_times(), np.linspace(0, 5, 129)[idx])
    owned = comm.mpi.allgather(idx)
    assert sorted(i for part in owned for i in part) == list(range(129))


# -- 1-D heat equation, PyMGRIT's example settings ---------------------------------

HEAT_NX, HEAT_NT, HEAT_T = 1001, 64, 2.0


def heat_rhs(x: np.ndarray, t: float) -> np.ndarray:
    rhs: np.ndarray = -np.sin(np.pi * x) * (np.sin(t) - np.pi**2 * np.cos(t))
    return rhs


def pymgrit_heat(levels: int, cycle_type: str = "V") -> np.ndarray:
    from pymgrit.core.mgrit import Mgrit
    from pymgrit.heat.heat_1d import Heat1D

    problem = [
        Heat1D(x_start=0, x_end=1, nx=HEAT_NX, a=1, init_cond=lambda x: np.sin(np.pi * x),
               rhs=heat_rhs, t_start=0, t_stop=HEAT_T, nt=HEAT_NT // 2**lvl + 1)
        for lvl in range(levels)
    ]  # fmt: skip
    solver = Mgrit(problem=problem, cf_iter=1, cycle_type=cycle_type, nested_iteration=False,
                   max_iter=10, comm_time=MPI.COMM_SELF, logging_lvl=30)  # fmt: skip
    return np.asarray(solver.solve()["conv"])


class HeatStep:
    """Backward Euler for u_t = u_xx + b on (0, 1), zero boundary values, batched.

    Each step solves the tridiagonal system (I + dt L) u_new = u + dt b with LAPACK's
    banded solver, all states of the batch at once.
    """

    def __init__(self) -> None:
        x = np.linspace(0, 1, HEAT_NX)[1:-1]
        self.x = torch.from_numpy(x)
        self.n, self.fac = len(x), 1.0 / (x[1] - x[0]) ** 2

    def __call__(self, u: torch.Tensor, t: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
        from scipy.linalg import solve_banded

        h = float(dt[0])
        bands = np.empty((3, self.n))
        bands[0], bands[1], bands[2] = -h * self.fac, 1 + 2 * h * self.fac, -h * self.fac
        t1, dt = (t + dt).view(-1, 1), dt.view(-1, 1)
        b = -torch.sin(np.pi * self.x) * (torch.sin(t1) - np.pi**2 * torch.cos(t1))
        rhs = (u + b * dt).numpy().T
        return torch.from_numpy(solve_banded((1, 1), bands, rhs).T.copy())


@pytest.mark.mpi
@pytest.mark.parametrize("cycle_type", ["V", "F"])
def test_heat_history_equals_pymgrit(cycle_type: str) -> None:
    levels = 5  # PyMGRIT's example hierarchy: 65, 33, 17, 9, 5 points
    ref = on_rank0(pymgrit_heat, levels, cycle_type)
    if cycle_type == "F":
        # The F-cycle's history is its own (not the V-cycle's under another name).
        other = on_rank0(pymgrit_heat, levels, "V")
        assert len(ref) != len(other) or not np.allclose(ref, other, rtol=1e-2)
    step = HeatStep()
    u0 = torch.sin(np.pi * step.x)
    histories = []
    for comm in {world(), self_comm()}:
        s = MGRIT(step, 0, HEAT_T, HEAT_NT, comm=comm, levels=levels, cfactor=2, max_iters=10,
                  tol=1e-7, skip_downcycle=False, vectorized=True,
                  cycle_type=cycle_type)  # fmt: skip
        final = s.solve(u0)
        histories.append(s.residuals)
    # Exact solution sin(pi x) cos(t), up to the discretisation error.
    torch.testing.assert_close(final, u0 * math.cos(HEAT_T), rtol=0, atol=2e-2)
    # Equal to rounding only: the batched matrix product rounds differently for other
    # batch sizes (blocks per rank); the histories' last entries sit near 1e-9.
    np.testing.assert_allclose(histories[0], histories[-1], rtol=1e-5)
    np.testing.assert_allclose(histories[0], ref, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("vectorized", [False, True])
def test_cuda_tensors_give_the_cpu_history(vectorized: bool) -> None:
    runs = []
    for device in ("cpu", "cuda"):
        s = MGRIT(dahlquist, 0, 5, 128, levels=3, cfactor=2, tol=1e-10, max_iters=20,
                  comm=self_comm(), vectorized=vectorized)  # fmt: skip
        final = s.solve(torch.ones(3, dtype=torch.float64, device=device))
        assert final.device.type == device
        assert s.local_solution().device.type == device
        runs.append(s.residuals)
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-12)


def test_a_failed_exchange_says_the_ranks_are_out_of_step() -> None:
    from mpx.mgrit.solver.ghosts import Ghosts

    # A rank that is its own neighbour on both sides, sending a state larger than
    # the ghost row it expects: as ranks out of step would (another level's shape).
    ghosts = Ghosts(self_comm(), left=0, right=0)
    shift = ghosts.start(torch.zeros(5), torch.zeros(3), tag=0)
    with pytest.raises(MGRITError, match=r"\(left, right\) = \(0, 0\).*shape \(3,\).*same order"):
        shift.finish()
    ghosts.channel.drain()
