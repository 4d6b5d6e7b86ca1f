"""A stage that fails fails the call on every stage, and the next call starts clean.

Size-agnostic (nox runs the file under 1, 2 and 3 ranks): the model has one
block per rank. Every failure is injected on one stage only; every stage must
then raise ``PipelineRemoteError`` naming that stage and its error, within the
communicator's timeout and not because of it, and the next step must give
exactly what the unpartitioned model gives.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from mpx.collectives import Communicator, allgather, world
from mpx.pipeline import Pipeline, PipelineError, PipelineRemoteError

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(240)]

D, OUT, BATCH, CHUNKS = 6, 3, 12, 3
TOL = 1e-10
TIMEOUT_S = 60.0  # only so that a hang fails the test; nothing here should wait for it


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("injected failure in a backward")


class Trap(nn.Module):
    """The identity, until armed: then it fails on micro-batch ``at`` of the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.mode: str | None = None
        self.at = 0
        self.seen = 0

    def arm(self, mode: str, at: int) -> None:
        self.mode, self.at, self.seen = mode, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is None:
            return x
        self.seen += 1
        if self.seen <= self.at:
            return x
        if self.mode == "raise":
            raise ValueError("injected user error in a stage")
        if self.mode == "shape":
            return x[:, :-1]  # the next Linear cannot take it
        return _RaiseInBackward.apply(x)  # type: ignore[no-any-return,no-untyped-call]


def make_model(stages: int) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(4321)
    layers: list[nn.Module] = []
    for s in range(stages):
        layers += [nn.Linear(D, D), nn.BatchNorm1d(D), nn.Tanh(), Trap()]
        if s == stages - 1:
            layers.append(nn.Linear(D, OUT))
    balance = [4] * stages
    balance[-1] += 1
    return nn.Sequential(*layers).double(), balance


def data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(BATCH, D, generator=g, dtype=torch.float64)
    return x, torch.randint(0, OUT, (BATCH,), generator=g)


def timed_comm() -> Communicator:
    return Communicator.from_mpi(world().mpi, timeout=TIMEOUT_S)


def reference_step(
    model: nn.Sequential, opt: torch.optim.Optimizer | None, x: torch.Tensor, y: torch.Tensor
) -> float:
    """The unpartitioned model, micro-batch by micro-batch (BatchNorm sees micro-batches)."""
    if opt is not None:
        opt.zero_grad()
    total = 0.0
    for xj, yj in zip(x.chunk(CHUNKS), y.chunk(CHUNKS), strict=True):
        loss = nn.functional.cross_entropy(model(xj), yj)
        (loss / CHUNKS).backward()
        total += loss.item() / CHUNKS
    if opt is not None:
        opt.step()
    return total


def assert_same(pipe: Pipeline, ref: nn.Sequential, grads: bool = True) -> None:
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, p in ref[index].named_parameters():
            torch.testing.assert_close(mine[name].detach(), p.detach(), rtol=0, atol=TOL)
            if grads:
                assert (mine[name].grad is None) == (p.grad is None), (index, name)
                if p.grad is not None:
                    torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=TOL)
        buffers = dict(layer.named_buffers())
        for name, b in ref[index].named_buffers():
            torch.testing.assert_close(buffers[name], b, rtol=0, atol=TOL)


# (what fails, the stage it fails on, the cause the message must name)
FAILURES = ["bad batch", "activation shape", "user error", "backward"]


def inject(pipe: Pipeline, failure: str, x: torch.Tensor) -> tuple[torch.Tensor, int, str]:
    """Arms ``failure``; returns the input to step with, the stage that fails, its error."""
    size = pipe.num_stages
    traps = [m for m in pipe.local_layers().values() if isinstance(m, Trap)]
    if failure == "bad batch":
        bad = torch.zeros(BATCH, D + 1, dtype=torch.float64) if pipe.first else x
        return bad, 0, "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    if failure == "activation shape":  # stage 0 sends a wrong shape to stage 1
        if pipe.first:
            traps[0].arm("shape", 0)
        return x, min(1, size - 1), "RuntimeError: mat1 and mat2 shapes cannot be multiplied"
    if failure == "user error":  # the last stage, in the middle of the call
        if pipe.last:
            traps[0].arm("raise", 1)
        return x, size - 1, "ValueError: injected user error in a stage"
    # The first stage fails in a backward, in its last one where the schedule
    # has it in this call: the other stages may have finished their part.
    if pipe.first:
        traps[0].arm("backward", 0 if pipe.schedule == "async" else CHUNKS - 1)
    return x, 0, "RuntimeError: injected failure in a backward"


def disarm(pipe: Pipeline) -> None:
    for m in pipe.local_layers().values():
        if isinstance(m, Trap):
            m.mode = None


def check_error(pipe: Pipeline, error: PipelineRemoteError, stage: int, cause: str) -> None:
    assert error.ranks == [stage], str(error)
    assert f"on rank {stage}: " in str(error)
    assert cause in str(error)
    assert f"schedule={pipe.schedule!r}" in str(error)
    if pipe.stage_id == stage:
        assert error.__cause__ is not None  # the stage's own error, chained


def fail_once(
    pipe: Pipeline,
    failure: str,
    x: torch.Tensor,
    y: torch.Tensor,
    opt: torch.optim.Optimizer | None,
) -> None:
    """A synchronous schedule raises in the call that failed, on every stage."""
    bad, stage, cause = inject(pipe, failure, x)
    with pytest.raises(PipelineRemoteError) as info:
        pipe.step(bad, y, nn.functional.cross_entropy, opt)
    disarm(pipe)
    check_error(pipe, info.value, stage, cause)


def fail_async(pipe: Pipeline, failure: str, opt: torch.optim.Optimizer | None) -> int:
    """Steps the failure, then a good batch; returns the call that raised (1 or 2).

    ``async`` reads a call's status a call late: a stage that had finished its
    part of the failed call learns of the failure in the next one. Every stage
    must then raise in that same call (else the first stage's inputs and the
    last stage's targets would belong to different batches afterwards).
    """
    x, y = data(1)
    bad, stage, cause = inject(pipe, failure, x)
    raised_in = 0
    for call, (xb, yb) in enumerate([(bad, y), data(2)], start=1):
        try:
            pipe.step(xb, yb, nn.functional.cross_entropy, opt)
        except PipelineRemoteError as error:
            disarm(pipe)
            check_error(pipe, error, stage, cause)
            raised_in = call
            break
    every = allgather(torch.tensor([raised_in]), comm=world())
    assert raised_in in (1, 2)
    assert torch.all(every == raised_in), every.tolist()
    return raised_in


@pytest.mark.parametrize("failure", FAILURES)
@pytest.mark.parametrize(
    ("schedule", "checkpoint"),
    [("sequential", "never"), ("gpipe", "never"), ("gpipe", "always"), ("1f1b", "never")],
)
def test_a_failed_step_raises_everywhere_and_the_next_starts_clean(
    schedule: str, checkpoint: str, failure: str
) -> None:
    model, balance = make_model(world().size)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS, schedule, checkpoint)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for seed in (1, 2):  # a step before, so that there is state to keep
        x, y = data(seed)
        assert (
            abs(
                pipe.step(x, y, nn.functional.cross_entropy, opt)
                - reference_step(ref, ref_opt, x, y)
            )
            < TOL
        )
    fail_once(pipe, failure, *data(3), opt)
    assert all(p.grad is None for p in pipe.parameters())  # the optimizer's step left none
    assert_same(pipe, ref, grads=False)  # no step taken, statistics put back
    for seed in (4, 5):
        x, y = data(seed)
        loss = pipe.step(x, y, nn.functional.cross_entropy, opt)
        assert abs(loss - reference_step(ref, ref_opt, x, y)) < TOL
        assert_same(pipe, ref)


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_step_leaves_accumulated_gradients_as_they_were(failure: str) -> None:
    model, balance = make_model(world().size)
    ref = copy.deepcopy(model)
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS, "1f1b")
    x, y = data(1)
    pipe.step(x, y, nn.functional.cross_entropy)  # no optimizer: gradients accumulate
    reference_step(ref, None, x, y)
    before = [p.grad.clone() for p in pipe.parameters() if p.grad is not None]
    fail_once(pipe, failure, *data(2), None)
    after = [p.grad for p in pipe.parameters() if p.grad is not None]
    assert len(after) == len(before) == len(list(pipe.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    x, y = data(3)
    pipe.step(x, y, nn.functional.cross_entropy)
    reference_step(ref, None, x, y)
    assert_same(pipe, ref)


@pytest.mark.parametrize("failure", FAILURES)
def test_async_restarts_its_stream_as_a_fresh_pipeline(failure: str) -> None:
    comm = world()
    model, balance = make_model(comm.size)
    fresh_model = copy.deepcopy(model)
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS, "async", weight_prediction="msnag")
    fresh = Pipeline(fresh_model, balance, timed_comm(), CHUNKS, "async", weight_prediction="msnag")
    fail_async(pipe, failure, None)  # no optimizer: nothing stepped before it failed
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    losses, fresh_losses = [], []
    for seed in (3, 4, 5):
        x, y = data(seed)
        losses.append(pipe.step(x, y, nn.functional.cross_entropy, opt))
        fresh_losses.append(fresh.step(x, y, nn.functional.cross_entropy, fresh_opt))
    losses.append(pipe.flush(opt))
    fresh_losses.append(fresh.flush(fresh_opt))
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(fresh_losses), rtol=0, atol=TOL, equal_nan=True
    )
    assert not any(math.isnan(loss) for loss in losses[1:])  # only the first call has none
    assert_same(pipe, fresh_model)


def test_async_failure_after_optimizer_steps_restarts_the_stream() -> None:
    # Steps taken before the failure stay; the stream restarts and trains on.
    model, balance = make_model(world().size)
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS, "async")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for seed in (3, 4):
        pipe.step(*data(seed), nn.functional.cross_entropy, opt)
    fail_async(pipe, "user error", opt)
    assert all(p.grad is None for p in pipe.parameters())  # the partial accumulation dropped
    restarted = pipe.step(*data(5), nn.functional.cross_entropy, opt)
    assert math.isnan(restarted)  # a fresh stream has no previous loss
    second = pipe.step(*data(6), nn.functional.cross_entropy, opt)
    last = pipe.flush(opt)
    assert not math.isnan(second)
    assert not math.isnan(last)
    again = pipe.flush(opt)
    assert math.isnan(again)  # nothing owed any more


def test_forward_only_call_fails_everywhere_and_the_next_works() -> None:
    model, balance = make_model(world().size)
    ref = copy.deepcopy(model).eval()
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS).eval()
    x, _ = data(1)
    bad = torch.zeros(BATCH, D + 1, dtype=torch.float64) if pipe.first else x
    with pytest.raises(
        PipelineRemoteError,
        match=r"Pipeline\.forward \(schedule='gpipe'\) failed on rank 0: forward of micro-batch 0",
    ):
        pipe(bad)
    out = pipe(x)
    if pipe.last:
        assert out is not None
        torch.testing.assert_close(out, ref(x).detach(), rtol=0, atol=TOL)


def test_argument_error_on_one_stage_only_raises_on_every_stage() -> None:
    # A batch size chunks does not divide, on the first stage only.
    model, balance = make_model(world().size)
    pipe = Pipeline(model, balance, timed_comm(), CHUNKS)
    x, y = data(1)
    with pytest.raises(PipelineError, match=r"on rank 0: checking the arguments: .*chunks=3"):
        pipe.step(x[:-1] if pipe.first else x, y, nn.functional.cross_entropy)
    pipe.step(x, y, nn.functional.cross_entropy)
