"""``Pipeline.close()`` frees the communicators the pipeline made, and only those.

Size-agnostic (nox runs the file under 1, 2 and 3 ranks): one Linear per rank.
MPICH has 2048 communicator ids per process and a Pipeline takes five (its
private duplicate of ``comm``: the duplicate, its node communicator, the
collectives' duplicate and two shared-memory windows), so a process that built
~400 pipelines failed with "Too many communicators (0/2048 free)". The ids
still free are counted by duplicating ``COMM_SELF`` until MPI refuses (MPI has
no call that tells), so every test asserts the exact count, not only that a
loop happened to fit.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpx.collectives import Communicator, allgather, allreduce, world
from mpx.pipeline import Pipeline, PipelineRemoteError, PipelineValueError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

D, BATCH, CHUNKS = 4, 6, 3


def free_ids() -> int:
    """The communicator ids MPI can still give this process."""
    made = []
    try:
        while True:
            made.append(MPI.COMM_SELF.Dup())
    except MPI.Exception:
        pass
    for c in made:
        c.Free()
    return len(made)


@contextlib.contextmanager
def room_for(ids: int) -> Iterator[None]:
    """Holds every communicator id but ``ids`` (as a long-running process would)."""
    held = [MPI.COMM_SELF.Dup() for _ in range(free_ids() - ids)]
    try:
        yield
    finally:
        for c in held:
            c.Free()


def make_model(stages: int, tied: bool = False) -> nn.Sequential:
    torch.manual_seed(7)
    model = nn.Sequential(*(nn.Linear(D, D) for _ in range(stages)))
    if tied and stages > 1:
        # The first and last stages own one weight: the pipeline splits a group for it.
        model[stages - 1].weight = model[0].weight
    return model.double()


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    return x, torch.randn(BATCH, D, generator=g, dtype=torch.float64)


def build(comm: Communicator | MPI.Intracomm, schedule: str = "gpipe") -> Pipeline:
    size = world().size
    v = 2 if schedule == "interleaved_1f1b" else None
    stages = size * (v or 1)
    model = make_model(stages, tied=schedule == "gpipe")
    chunks = size if v else CHUNKS  # interleaved: rounds of one micro-batch per rank
    return Pipeline(model, [1] * stages, comm, chunks, schedule, stages_per_rank=v)


def train(pipe: Pipeline, calls: int) -> None:
    opt = torch.optim.SGD(pipe.parameters(), lr=0.05)
    for seed in range(calls):
        pipe.step(*data(seed), nn.functional.mse_loss, opt)


def same_everywhere(value: int) -> list[int]:
    return [int(v) for v in allgather(torch.tensor([value]), comm=world()).flatten().tolist()]


@pytest.fixture(autouse=True)
def warm() -> None:
    """What the first pipeline of a process creates once and keeps (world(), the
    collectives' caches on it) is made before a test counts."""
    build(world()).close()


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "async"])
def test_close_frees_every_communicator_the_pipeline_made(schedule: str) -> None:
    comm = world()
    before = free_ids()
    pipe = build(comm, schedule)
    mine = [pipe.comm, *(group for _, group, _ in pipe._tied)]
    assert free_ids() < before
    # async leaves its last sends and its status in flight: close settles them.
    train(pipe, 3)
    pipe.close()
    assert free_ids() == before
    assert all(c.mpi == MPI.COMM_NULL for c in mine)
    pipe.close()  # idempotent
    assert free_ids() == before
    # The user's communicator is the user's: it still works.
    assert comm.mpi != MPI.COMM_NULL
    assert allreduce(torch.ones(1), "sum", comm=comm).item() == comm.size


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b", "async"])
def test_a_closed_and_dropped_pipeline_is_freed(schedule: str) -> None:
    # Its channel's finalizer once held the channel's whole __dict__ (the interrupt,
    # and through it the pipeline): every Pipeline stayed in memory (~57 KiB each).
    pipe = build(world(), schedule)
    train(pipe, 2)
    pipe.close()
    dropped: list[weakref.ref[object]] = [
        weakref.ref(pipe),
        weakref.ref(pipe.comm),
        weakref.ref(pipe._runtime),
    ]
    del pipe
    gc.collect()
    assert [ref() is None for ref in dropped] == [True, True, True]


@pytest.mark.parametrize("call", ["step", "forward", "flush"])
def test_a_closed_pipeline_raises_naming_close(call: str) -> None:
    pipe = build(world(), "async")
    train(pipe, 2)
    pipe.close()
    x, y = data(0)
    calls: dict[str, Callable[[], object]] = {
        "step": lambda: pipe.step(x, y, nn.functional.mse_loss),
        "forward": lambda: pipe(x),
        "flush": pipe.flush,
    }
    with pytest.raises(PipelineValueError, match=rf"Pipeline\.{call}: .*Pipeline\.close\(\)"):
        calls[call]()
    assert pipe.state_dict().keys()  # the weights stay the caller's


@pytest.mark.parametrize("kind", ["split", "COMM_WORLD"])
def test_the_comm_passed_in_is_never_freed(kind: str) -> None:
    user = world().split(0) if kind == "split" else world()
    assert user is not None
    passed: Communicator | MPI.Intracomm = user if kind == "split" else MPI.COMM_WORLD
    before = free_ids()
    pipe = build(passed)
    train(pipe, 1)
    pipe.close()
    assert free_ids() == before
    assert user.mpi != MPI.COMM_NULL
    assert allreduce(torch.ones(1), "sum", comm=passed).item() == user.size
    again = build(passed)  # the same communicator takes another pipeline
    train(again, 1)
    again.close()
    if kind == "split":
        user.free()


@pytest.mark.parametrize(
    "bad",
    [{"chunks": 0}, {"checkpoint": "sometimes"}, {"pass_costs": "guessed"}],
    ids=["chunks", "checkpoint", "pass_costs"],
)
def test_a_pipeline_that_fails_to_build_frees_what_it_made(bad: dict[str, object]) -> None:
    before = free_ids()
    size = world().size
    args: dict[str, object] = {"chunks": CHUNKS, "checkpoint": "never", **bad}
    for _ in range(3):
        with pytest.raises(PipelineValueError):
            Pipeline(make_model(size), [1] * size, world(), **args)  # type: ignore[arg-type]
    assert free_ids() == before


def test_many_pipelines_fit_in_the_ids_of_a_few() -> None:
    """Room for four pipelines at a time, thirty built, trained and closed in turn."""
    with room_for(20):
        for _ in range(30):
            pipe = build(world())
            train(pipe, 1)
            pipe.close()
        assert free_ids() == 20


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in a backward")


class _FailsOnce(nn.Module):
    """The identity; the backward of its first micro-batch raises."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.armed:
            return x
        self.armed = False
        return _RaiseInBackward.apply(x)  # type: ignore[no-any-return,no-untyped-call]


def test_close_after_an_async_failure_raises_it_on_every_stage_once() -> None:
    """``async`` reads a call's status a call late: a stage may return from the call
    that failed elsewhere and close while the stage that failed is settling. The
    failure is raised once on every stage, by the call or by close(), and nothing hangs."""
    comm = world()
    size = comm.size
    before = free_ids()
    first, *rest = make_model(size)
    model = nn.Sequential(first, _FailsOnce(), *rest)  # stage 0 fails in a backward
    pipe = Pipeline(model, [2] + [1] * (size - 1), comm, CHUNKS, "async")
    raised: list[PipelineRemoteError] = []
    # Stage 0 runs its first backward in the first call or the second (the
    # stream fills first): the failure is raised in one of them, or by close().
    for seed in (1, 2):
        try:
            pipe.step(*data(seed), nn.functional.mse_loss)
        except PipelineRemoteError as error:
            raised.append(error)
    try:
        pipe.close()
    except PipelineRemoteError as error:
        raised.append(error)
    assert len(raised) == 1, raised
    assert raised[0].ranks == [0], str(raised[0])
    assert "injected failure in a backward" in str(raised[0])
    assert free_ids() == before
    assert same_everywhere(len(raised)) == [1] * size
