"""Transparency: a pipelined step gives the gradients of the unpartitioned model.

Every test is size-agnostic: the model has one block of layers per rank, so it
splits over ``world().size`` stages; nox runs the file under 1, 2 and 3 ranks.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.pipeline import Pipeline, PipelineError, PipelineRemoteError
from mpx.pipeline.model.partition import tied_groups

pytestmark = pytest.mark.mpi

D, OUT, BATCH = 6, 3, 12
TOL = 1e-10


def seed_of(seed: int, microbatch: int, layer: int) -> int:
    # The documented formula, written out again here (not imported).
    return ((seed * 1_000_003 + microbatch) * 1_000_003 + layer) % 2**63


def block(dropout: bool, batchnorm: bool, inplace_first: bool) -> list[nn.Module]:
    layers: list[nn.Module] = []
    if inplace_first:
        layers.append(nn.ReLU(inplace=True))
    layers += [nn.Linear(D, D), nn.Tanh()]
    if batchnorm:
        layers.append(nn.BatchNorm1d(D))
    if dropout:
        layers.append(nn.Dropout(0.3))
    return layers


def make_model(
    stages: int, dropout: bool = False, batchnorm: bool = False, inplace_first: bool = False
) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(1234)
    layers: list[nn.Module] = []
    balance = []
    for s in range(stages):
        blk = block(dropout, batchnorm, inplace_first)
        if s == stages - 1:
            blk.append(nn.Linear(D, OUT))
        layers += blk
        balance.append(len(blk))
    return nn.Sequential(*layers).double(), balance


def data(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, D, generator=g, dtype=torch.float64), torch.randint(
        0, OUT, (BATCH,), generator=g
    )


def reference_by_microbatch(
    model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, chunks: int, seed: int = 0
) -> float:
    """The unpartitioned model, micro-batch by micro-batch, with the pipeline's seeds."""
    total = 0.0
    for j, (xj, yj) in enumerate(zip(x.chunk(chunks), y.chunk(chunks), strict=True)):
        h = xj.clone()
        for i, layer in enumerate(model):
            torch.manual_seed(seed_of(seed, j, i))
            h = layer(h)
        loss = nn.functional.cross_entropy(h, yj)
        (loss / chunks).backward()
        total += loss.item() / chunks
    return total


def compare(pipe: Pipeline, ref: nn.Sequential) -> None:
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, p in ref[index].named_parameters():
            assert mine[name].grad is not None, (index, name)
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=TOL)
        mine_buffers = dict(layer.named_buffers())
        for name, b in ref[index].named_buffers():
            torch.testing.assert_close(mine_buffers[name], b, rtol=0, atol=TOL)


SYNC = [
    ("sequential", "never"),
    ("gpipe", "never"),
    ("gpipe", "except_last"),
    ("gpipe", "always"),
    ("1f1b", "never"),
    ("1f1b", "always"),
]


@pytest.mark.parametrize(("schedule", "checkpoint"), SYNC)
@pytest.mark.parametrize("chunks", [1, 4])
def test_gradients_equal_the_whole_batch(schedule: str, checkpoint: str, chunks: int) -> None:
    comm = world()
    model, balance = make_model(comm.size)
    ref, _ = make_model(comm.size)
    x, y = data()
    pipe = Pipeline(model, balance, chunks=chunks, schedule=schedule, checkpoint=checkpoint)
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    ref_loss = nn.functional.cross_entropy(ref(x), y)
    ref_loss.backward()
    compare(pipe, ref)
    assert abs(loss - ref_loss.item()) < TOL


@pytest.mark.parametrize(("schedule", "checkpoint"), SYNC)
def test_dropout_and_batchnorm_match_the_microbatch_reference(
    schedule: str, checkpoint: str
) -> None:
    # Micro-batches see their own BatchNorm statistics and their own dropout
    # masks: the reference runs the whole model micro-batch by micro-batch with
    # the same seeds. Running statistics move once per micro-batch, also when
    # the micro-batch is recomputed.
    comm = world()
    model, balance = make_model(comm.size, dropout=True, batchnorm=True)
    ref, _ = make_model(comm.size, dropout=True, batchnorm=True)
    x, y = data()
    pipe = Pipeline(model, balance, chunks=3, schedule=schedule, checkpoint=checkpoint)
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    ref_loss = reference_by_microbatch(ref, x, y, chunks=3)
    compare(pipe, ref)
    assert abs(loss - ref_loss) < TOL
    # The masks really differ by micro-batch (the check above can fail).
    other, _ = make_model(comm.size, dropout=True, batchnorm=True)
    torch.manual_seed(0)
    other_loss = nn.functional.cross_entropy(other(x), y)
    assert abs(other_loss.item() - ref_loss) > 1e-6


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_inplace_first_layer_of_every_stage(checkpoint: str) -> None:
    comm = world()
    model, balance = make_model(comm.size, dropout=True, inplace_first=True)
    ref, _ = make_model(comm.size, dropout=True, inplace_first=True)
    x, y = data()
    x_before = x.clone()
    pipe = Pipeline(model, balance, chunks=2, schedule="1f1b", checkpoint=checkpoint)
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    assert torch.equal(x, x_before)  # the caller's batch is not overwritten
    ref_loss = reference_by_microbatch(ref, x, y, chunks=2)
    compare(pipe, ref)
    assert abs(loss - ref_loss) < TOL


def test_second_step_with_optimizer_and_forward_only() -> None:
    comm = world()
    model, balance = make_model(comm.size)
    ref, _ = make_model(comm.size)
    pipe = Pipeline(model, balance, chunks=2, schedule="gpipe")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    for seed in (1, 2, 3):
        x, y = data(seed)
        loss = pipe.step(x, y, nn.functional.cross_entropy, opt, sched)
        ref_opt.zero_grad()
        ref_loss = nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        ref_opt.step()
        ref_sched.step()
        assert abs(loss - ref_loss.item()) < TOL
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 / 8
    compare(pipe, ref)
    x, _ = data(9)
    out = pipe(x)
    if pipe.last:
        assert out is not None
        torch.testing.assert_close(out, ref(x).detach(), rtol=0, atol=TOL)
    else:
        assert out is None


def test_loss_is_the_same_on_every_rank() -> None:
    comm = world()
    model, balance = make_model(comm.size)
    pipe = Pipeline(model, balance, chunks=2)
    x, y = data()
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    every = torch.tensor([loss], dtype=torch.float64)
    from mpx.collectives import allgather

    assert torch.all(allgather(every) == loss)


def test_balance_none_profiles_and_splits() -> None:
    comm = world()
    model, _ = make_model(comm.size)
    x, y = data()
    pipe = Pipeline(model, None, chunks=2, sample=x[:6])
    assert len(pipe.balance) == comm.size
    assert sum(pipe.balance) == len(model)
    every = torch.tensor(pipe.balance)
    from mpx.collectives import allgather

    assert torch.all(allgather(every) == every)  # every rank agrees
    pipe.step(x, y, nn.functional.cross_entropy)


@pytest.mark.parametrize("schedule", ["interleaved_1f1b", "zbv"])
def test_balance_none_with_two_chunks_a_rank_weighs_each_ranks_chunks(
    schedule: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mpx.pipeline import pipeline as pipeline_module
    from mpx.pipeline import split_times
    from mpx.pipeline.schedules.table import placement, rank_of

    p = world().size
    # Layer times as if measured (the same on every rank, as after the broadcast).
    times = [2.0, 3.0, 2.0, 3.0, 2.0, 2.0, 2.0, 1.0, 2.0, 1.0]
    monkeypatch.setattr(pipeline_module, "layer_times", lambda module, sample: list(times))
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in times))
    pipe = Pipeline(
        model, None, chunks=2 * p, schedule=schedule, stages_per_rank=2, sample=torch.zeros(1, 4)
    )
    ranks = [rank_of(s, p, placement(schedule)) for s in range(2 * p)]
    assert pipe.balance == split_times(times, 2 * p, ranks, 2 * p)
    if p == 2:  # the split of the chunks alone loads one rank more: 2 2 2 4 on ranks 0 1 0 1
        assert pipe.balance == ([2, 3, 3, 2] if schedule == "interleaved_1f1b" else [3, 1, 4, 2])
    pipe.step(torch.randn(4 * p, 4), torch.randn(4 * p, 4), nn.functional.mse_loss)


def test_bad_arguments_give_clear_errors() -> None:
    comm = world()
    model, balance = make_model(comm.size)
    with pytest.raises(PipelineError, match="ranks"):
        Pipeline(model, [*balance, 1])
    with pytest.raises(PipelineError, match="sums to"):
        Pipeline(model, [b + 1 for b in balance])
    with pytest.raises(PipelineError, match="not one of"):
        Pipeline(model, balance, schedule="zigzag")
    with pytest.raises(PipelineError, match=r"nn\.Sequential"):
        Pipeline(nn.ModuleList(model), balance)  # type: ignore[arg-type]
    with pytest.raises(PipelineError, match="async"):
        Pipeline(model, balance, schedule="gpipe", step_every=2)
    with pytest.raises(PipelineError, match="sample"):
        Pipeline(model, None)
    # The first stage cannot time the layers on this sample: every stage says so.
    with pytest.raises(PipelineRemoteError, match=r"could not time the layers on rank 0: Runt"):
        Pipeline(model, None, sample=torch.zeros(2, 999))
    pipe = Pipeline(model, balance, chunks=5)
    x, y = data()
    with pytest.raises(PipelineError, match="chunks=5"):
        pipe.step(x, y, nn.functional.cross_entropy)


def test_tied_weights_across_stages_are_found() -> None:
    comm = world()
    model, balance = make_model(max(comm.size, 2))
    model[balance[0]].weight = model[0].weight  # first Linear of stage 1 = stage 0's
    assert tied_groups(model, balance) == [{0: (0, "weight"), 1: (balance[0], "weight")}]
    assert tied_groups(model, [balance[0] + balance[1], *balance[2:]]) == []  # one stage


def test_two_dimensional_pipeline_times_data_parallel() -> None:
    # Two layouts of the same ranks: n stages x 1 replica, and 1 stage x n
    # replicas. Replica r trains on its slice of the batch; the average of the
    # replicas' gradients is the whole batch's.
    comm = world()
    n = comm.size
    x, y = data()
    x, y = torch.cat([x] * n), torch.cat([y] * n) + 0
    x = x + 0.01 * torch.arange(len(x), dtype=torch.float64)[:, None]
    for stages in sorted({n, 1}):
        replicas = n // stages
        replica, stage = divmod(comm.rank, stages)
        stage_comm = comm.split(replica, stage)
        replica_comm = comm.split(stage, replica)
        assert stage_comm is not None
        assert replica_comm is not None
        model, balance = make_model(stages)
        ref, _ = make_model(stages)
        pipe = Pipeline(model, balance, comm=stage_comm, chunks=2, data_parallel_comm=replica_comm)
        per = len(x) // replicas
        mine = slice(replica * per, (replica + 1) * per)
        loss = pipe.step(x[mine], y[mine], nn.functional.cross_entropy)
        ref_loss = nn.functional.cross_entropy(ref(x), y)
        ref_loss.backward()
        compare(pipe, ref)
        assert abs(loss - ref_loss.item()) < TOL


@pytest.mark.parametrize("schedule", ["gpipe", "async"])
def test_batch_size_may_change_between_calls(schedule: str) -> None:
    # Every call's header carries the shape; receive buffers follow it.
    comm = world()
    model, balance = make_model(comm.size)
    ref, _ = make_model(comm.size)
    pipe = Pipeline(model, balance, chunks=2, schedule=schedule)
    for size in (12, 8, 12, 4):
        x, y = data(size)
        x, y = x[:size], y[:size]
        pipe.step(x, y, nn.functional.cross_entropy)
        nn.functional.cross_entropy(ref(x[: size // 2]), y[: size // 2]).backward()
        nn.functional.cross_entropy(ref(x[size // 2 :]), y[size // 2 :]).backward()
    pipe.flush()
    if schedule == "gpipe":
        # Gradients accumulate over the calls: sum of mean micro-batch losses / 2.
        for index, layer in pipe.local_layers().items():
            for (name, p), q in zip(layer.named_parameters(), ref[index].parameters(), strict=True):
                assert p.grad is not None
                assert q.grad is not None
                torch.testing.assert_close(p.grad, q.grad / 2, rtol=0, atol=TOL, msg=name)
    out = pipe(torch.zeros(6, D, dtype=torch.float64))
    assert (out is not None) == pipe.last
    if out is not None:
        assert out.shape == (6, OUT)


def test_an_mpi4py_communicator_is_accepted_as_comm() -> None:
    """torchbraid's convention, comm=MPI.COMM_WORLD (an AttributeError before)."""
    from mpi4py import MPI

    comm = world()
    model, balance = make_model(comm.size)
    pipe = Pipeline(model, balance, chunks=2, comm=MPI.COMM_WORLD)
    assert pipe.num_stages == comm.size
    x, y = data()
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    assert torch.isfinite(torch.tensor(loss))


@pytest.mark.parametrize(
    ("schedule", "v"),
    [("1f1b", None), ("interleaved_1f1b", 2), ("interleaved_zb", 2), ("zbv", 2), ("dualpipev", 2)],
)
def test_every_schedule_equals_the_whole_batch_and_reaches_the_input(
    schedule: str, v: int | None
) -> None:
    """Gradients (weights and an input that requires grad) of the unpartitioned model,
    also with two chunks per rank and the backward split into I and W."""
    comm = world()
    stages = comm.size * (v or 1)
    model, balance = make_model(stages)
    ref, _ = make_model(stages)
    x, y = data()
    chunks = 2 * comm.size if v else 4
    x = x[: 2 * chunks].clone().requires_grad_()
    y = y[: 2 * chunks]
    ref_x = x.detach().clone().requires_grad_()
    pipe = Pipeline(model, balance, chunks=chunks, schedule=schedule, stages_per_rank=v)
    loss = pipe.step(x, y, nn.functional.cross_entropy)
    ref_loss = nn.functional.cross_entropy(ref(ref_x), y)
    ref_loss.backward()
    compare(pipe, ref)
    assert abs(loss - ref_loss.item()) < TOL
    if pipe.first:
        assert x.grad is not None
        assert ref_x.grad is not None
        torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=TOL)


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_pass_costs_move_the_w_passes_not_the_results(schedule: str) -> None:
    """Laid out by unit costs, by given costs (W five times an I, every other stage),
    or by the times measured in call MEASURE_AT: other lists, the same losses and
    weights bit for bit; the measured times are alike on every rank."""
    from mpi4py import MPI

    from mpx.pipeline.pipeline import MEASURE_AT
    from mpx.pipeline.schedules.table import rank_actions

    comm = world()
    n = comm.size * 2
    skewed = {"F": [1.0] * n, "I": [1.0] * n, "W": [1.0 + 4 * (s % 2) for s in range(n)]}
    x, y = data()
    chunks = 2 * comm.size
    x, y = x[: 2 * chunks], y[: 2 * chunks]
    runs = []
    for costs in ("unit", skewed, "measured"):
        model, balance = make_model(n)
        pipe = Pipeline(
            model, balance, chunks=chunks, schedule=schedule, stages_per_rank=2, pass_costs=costs
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = [pipe.step(x, y, nn.functional.cross_entropy, opt) for _ in range(MEASURE_AT + 1)]
        runs.append((pipe, losses))
    (unit, unit_losses), (given, _), (measured, _) = runs
    assert unit.pass_costs is None
    assert given.pass_costs == skewed
    got = measured.pass_costs
    assert got is not None
    assert sorted(got) == ["F", "I", "W"]
    assert all(len(got[k]) == n and min(got[k]) >= 1 for k in got)
    assert MPI.COMM_WORLD.allgather(got) == [got] * comm.size
    if comm.size > 1:  # one rank has no one to wait for: the same list either way
        lists = [
            [rank_actions(schedule, r, comm.size, chunks, 2, costs=c) for r in range(comm.size)]
            for c in (None, skewed)
        ]
        assert lists[0] != lists[1]
    for pipe, losses in runs[1:]:
        assert losses == unit_losses
        for (name, a), b in zip(unit.named_parameters(), pipe.parameters(), strict=True):
            assert torch.equal(a, b), name
    model, balance = make_model(n)
    with pytest.raises(PipelineError, match="pass_costs='fast' is not 'measured', 'unit'"):
        Pipeline(model, balance, chunks=chunks, schedule=schedule, pass_costs="fast")


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved_zb"])
def test_a_loss_fn_may_keep_the_last_stage_output(schedule: str, checkpoint: str) -> None:
    """A last stage that returns its input unchanged (``nn.Identity``) or as a view
    (``nn.Flatten``): ``loss_fn`` gets a tensor of its own, not the pooled receive buffer
    the next message refills; what it keeps (predictions for a metric) keeps its values."""
    comm = world()
    v = 2 if schedule == "interleaved_zb" else 1
    n = comm.size * v
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(D, D).double() for _ in range(n - 1)]
    model = nn.Sequential(*layers, nn.Flatten(0, -1) if n % 2 else nn.Identity())
    pipe = Pipeline(
        model,
        [1] * n,
        chunks=2,
        schedule=schedule,
        checkpoint=checkpoint,
        stages_per_rank=v if v > 1 else None,
    )
    kept: list[torch.Tensor] = []
    seen: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        kept.append(out.detach())
        seen.append(out.detach().clone())
        return ((out.reshape(target.shape) - target) ** 2).sum()

    for seed in range(3):
        x, _ = data(seed)
        x = x[:4, :D].requires_grad_()  # one rank: the Identity is the whole model
        pipe.step(x, torch.zeros(4, D, dtype=torch.float64), loss_fn)
    assert len(kept) == (6 if pipe.last else 0) * (2 if checkpoint == "always" else 1)
    for got, then in zip(kept, seen, strict=True):
        assert torch.equal(got, then)


class Stall(nn.Module):
    """Passes its input on, sleeping first while :attr:`on` is set (a disturbed call)."""

    on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if Stall.on:
            # Far above any pass's noise: in CI, beside the build lane, a block's
            # forward took up to 7 ms and its I 12 ms (a 20 ms stall was not 10x them).
            time.sleep(0.2)
        return x


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_one_disturbed_call_does_not_set_the_measured_layout(schedule: str) -> None:
    """pass_costs="measured": the passes' times are every pass's median over the calls
    MEASURE_AT to MEASURE_AT + MEASURE_CALLS - 1; a call whose stage-0 forwards stalled
    sets the layout only until the calls after it outvote it, and calls after those are
    not timed."""
    from mpi4py import MPI

    from mpx.pipeline.pipeline import MEASURE_AT, MEASURE_CALLS

    comm = world()
    n = comm.size * 2
    model, balance = make_model(n)
    model, balance = nn.Sequential(Stall(), *model), [balance[0] + 1, *balance[1:]]
    x, y = data()
    chunks = 2 * comm.size
    x, y = x[: 2 * chunks], y[: 2 * chunks]
    pipe = Pipeline(model, balance, chunks=chunks, schedule=schedule, stages_per_rank=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    costs = []
    try:
        for call in range(1, MEASURE_AT + MEASURE_CALLS + 1):
            Stall.on = call == MEASURE_AT
            pipe.step(x, y, nn.functional.cross_entropy, opt)
            costs.append(pipe.pass_costs)
    finally:
        Stall.on = False
    stalled, settled = costs[MEASURE_AT - 1], costs[MEASURE_AT + MEASURE_CALLS - 2]
    assert stalled is not None
    assert settled is not None
    # 200 ms a forward against a block's fraction of a millisecond: by far the dearest pass.
    assert stalled["F"][0] > 10 * max(stalled["F"][1:]), stalled
    assert settled["F"][0] < 10 * max(settled["F"][1:]), settled
    assert costs[-1] == settled
    assert MPI.COMM_WORLD.allgather(settled) == [settled] * comm.size
