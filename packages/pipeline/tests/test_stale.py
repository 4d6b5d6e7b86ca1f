"""schedule="async": staleness, stashing, an exact serial reference, convergence."""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import allgather, world
from mpx.pipeline import Pipeline, PipelineError
from mpx.pipeline.schedules.table import Action, AsyncLayout, async_actions, async_flush_actions

pytestmark = pytest.mark.mpi

D, OUT = 5, 3
LR = 0.1


def make_model(stages: int) -> tuple[nn.Sequential, list[int]]:
    torch.manual_seed(99)
    layers: list[nn.Module] = []
    balance = []
    for s in range(stages):
        blk: list[nn.Module] = [nn.Linear(D, D), nn.Tanh()]
        if s == stages - 1:
            blk.append(nn.Linear(D, OUT))
        layers += blk
        balance.append(len(blk))
    return nn.Sequential(*layers).double(), balance


def batches(calls: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [
        (
            torch.randn(size, D, generator=g, dtype=torch.float64),
            torch.randint(0, OUT, (size,), generator=g),
        )
        for _ in range(calls)
    ]


def stream_lists(p: int, v: int, split: bool, calls: int, chunks: int) -> list[list[Action]]:
    """Per rank, the compute actions of ``calls`` calls and a flush (``step_every=1``)."""
    if v == 1 and not split:
        out = []
        for r in range(p):
            acts: list[Action] = []
            f = b = 0
            for c in range(calls):
                new = async_actions(p - r - 1, f, b, (c + 1) * chunks, r, 1)
                f += sum(a.kind == "F" for a in new)
                b += sum(a.kind == "B" for a in new)
                acts += new
            out.append(acts + async_flush_actions(f, b, r, 1))
        return out
    layout = AsyncLayout(p, v, split)
    out = [[] for _ in range(p)]
    for c in range(calls):
        for r, acts in enumerate(layout.call((c + 1) * chunks, 1)):
            out[r] += acts
    for r, acts in enumerate(layout.call(calls * chunks, 1, flush=True)):
        out[r] += acts
    return out


def stream_versions(
    lists: list[list[Action]], n: int
) -> tuple[list[dict[int, int]], list[dict[int, int]], list[list[int]]]:
    """From the lists: vf[s][j] and vb[s][j], the steps virtual stage ``s`` has taken
    at F(j) and at the backward of j (its I or B); per rank, the staleness of its
    backwards in its order."""
    vf: list[dict[int, int]] = [{} for _ in range(n)]
    vb: list[dict[int, int]] = [{} for _ in range(n)]
    stale: list[list[int]] = []
    version = [0] * n
    for r, acts in enumerate(lists):
        mine = []
        for a in acts:
            if a.kind == "F":
                vf[a.stage][a.mb] = version[a.stage]
            elif a.kind in ("I", "B"):
                vb[a.stage][a.mb] = version[a.stage]
                mine.append(version[a.stage] - vf[a.stage][a.mb])
            elif a.kind == "STEP":
                version[r if a.stage < 0 else a.stage] += 1
        stale.append(mine)
    return vf, vb, stale


def serial_reference(
    model: nn.Sequential,
    balance: list[int],
    data: list[tuple[torch.Tensor, torch.Tensor]],
    chunks: int,
    stashing: bool,
    recompute: bool,
    versions: tuple[list[dict[int, int]], list[dict[int, int]]],
) -> dict[int, dict[str, torch.Tensor]]:
    """PipeDream semantics run serially: virtual stage s's weights after every backward.

    Returns the final state of every layer, by its index in ``model``.
    """
    n = len(balance)
    vf, vb = versions
    bounds = list(itertools.accumulate([0, *balance]))
    stages = [
        copy.deepcopy(nn.Sequential(*list(model)[bounds[s] : bounds[s + 1]])) for s in range(n)
    ]
    history = [[{k: v.clone() for k, v in st.state_dict().items()}] for st in stages]
    micro = [
        (x, y) for xb, yb in data for x, y in zip(xb.chunk(chunks), yb.chunk(chunks), strict=True)
    ]
    for j, (x, y) in enumerate(micro):
        acts = [x]
        with torch.no_grad():
            for s in range(n):
                stages[s].load_state_dict(history[s][vf[s][j]])
                acts.append(stages[s](acts[-1]))
        grad = None
        for s in reversed(range(n)):
            # Backward weights: the forward's when stashed or kept in the graph,
            # else those current at the backward.
            version = vf[s][j] if (stashing or not recompute) else vb[s][j]
            stages[s].load_state_dict(history[s][version])
            stages[s].zero_grad()
            inp = acts[s].clone().requires_grad_(s > 0)
            out = stages[s](inp)
            if s == n - 1:
                nn.functional.cross_entropy(out, y).backward()
            else:
                out.backward(grad)
            grad = inp.grad
            new = {k: v.clone() for k, v in history[s][j].items()}
            for name, prm in stages[s].named_parameters():
                assert prm.grad is not None
                new[name] -= LR * prm.grad
            history[s].append(new)
    final: dict[int, dict[str, torch.Tensor]] = {}
    for s in range(n):
        for name, value in history[s][-1].items():
            i, key = name.split(".", 1)
            final.setdefault(bounds[s] + int(i), {})[key] = value
    return final


def assert_equals_reference(pipe: Pipeline, expected: dict[int, dict[str, torch.Tensor]]) -> None:
    for index, layer in pipe.stage.layer_modules().items():
        for key, value in layer.state_dict().items():
            torch.testing.assert_close(value, expected[index][key], rtol=0, atol=1e-10)


@pytest.mark.parametrize(("v", "split"), [(1, False), (1, True), (2, False), (2, True)])
@pytest.mark.parametrize(
    ("stashing", "recompute"), [(True, False), (True, True), (False, True), (False, False)]
)
def test_async_equals_the_serial_pipedream_reference(
    v: int, split: bool, stashing: bool, recompute: bool
) -> None:
    """Every virtual stage is a PipeDream stage (its own steps and staleness); with
    split_backward each backward is I (sent upstream at once) then W, deferred into
    idle time: the weights each pass uses follow the action lists, and the serial
    reference replays them."""
    comm = world()
    n = comm.size * v
    model, balance = make_model(n)
    ref_model, _ = make_model(n)
    calls, chunks = 4, 3
    data = batches(calls, 6)
    pipe = Pipeline(
        model,
        balance,
        chunks=chunks,
        schedule="async",
        weight_stashing=stashing,
        recompute=recompute,
        stages_per_rank=v,
        split_backward=split,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    kinds: set[str] = set()
    for x, y in data:
        pipe.step(x, y, nn.functional.cross_entropy, opt)
        kinds |= {a.kind for a, _, _ in pipe.trace}
    pipe.flush(opt)
    assert ({"I", "W"} <= kinds and "B" not in kinds) if split else "I" not in kinds
    vf, vb, stale = stream_versions(stream_lists(comm.size, v, split, calls, chunks), n)
    expected = serial_reference(ref_model, balance, data, chunks, stashing, recompute, (vf, vb))
    assert_equals_reference(pipe, expected)
    assert pipe._stale is not None
    assert pipe._stale.staleness == stale[comm.rank]
    if v == 1 and not split:
        # The staleness of backward j is min(j, depth): depth in steady state.
        depth = comm.size - 1 - comm.rank
        assert stale[comm.rank] == [min(j, depth) for j in range(calls * chunks)]
    if any(any(row) for row in stale) and not stashing and recompute:
        # With any staleness, the result without stashing differs from the
        # stashed reference (the test can tell the two apart).
        other = serial_reference(ref_model, balance, data, chunks, True, recompute, (vf, vb))
        differs = any(
            not torch.allclose(value, other[index][key], atol=1e-8)
            for index, layer in pipe.stage.layer_modules().items()
            for key, value in layer.state_dict().items()
        )
        flags = allgather(torch.tensor([int(differs)]))
        assert bool(flags.any())


def test_forward_between_async_steps_leaves_training_unchanged() -> None:
    """A ``step`` leaves its last sends in flight; an evaluation pass between
    steps (no flush) must neither mix its messages with them nor change the
    training (the PipeDream reference still holds)."""
    comm = world()
    model, balance = make_model(comm.size)
    ref_model, _ = make_model(comm.size)
    calls, chunks = 4, 3
    data = batches(calls, 6)
    pipe = Pipeline(model, balance, chunks=chunks, schedule="async")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    for x, y in data:
        pipe.step(x, y, nn.functional.cross_entropy, opt)
        out = pipe(x)
        if comm.rank == comm.size - 1:
            assert out is not None
            assert out.shape == (6, OUT)
            assert bool(out.isfinite().all())
        else:
            assert out is None
    pipe.flush(opt)
    vf, vb, _ = stream_versions(stream_lists(comm.size, 1, False, calls, chunks), comm.size)
    assert_equals_reference(
        pipe, serial_reference(ref_model, balance, data, chunks, True, False, (vf, vb))
    )


def test_one_stage_async_is_plain_sgd_per_microbatch() -> None:
    # Each rank alone: depth 0, no staleness; every micro-batch is a step.
    comm = world()
    solo = comm.split(comm.rank)
    model, balance = make_model(1)
    ref, _ = make_model(1)
    pipe = Pipeline(model, balance, comm=solo, chunks=2, schedule="async", step_every=2)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    losses, ref_losses = [], []
    for x, y in batches(3, 4):
        losses.append(pipe.step(x, y, nn.functional.cross_entropy, opt))
        ref_opt.zero_grad()
        total = 0.0
        for xj, yj in zip(x.chunk(2), y.chunk(2), strict=True):
            loss = nn.functional.cross_entropy(ref(xj), yj)
            (loss / 2).backward()
            total += loss.item() / 2
        ref_opt.step()
        ref_losses.append(total)
    # Losses come one call late (no synchronisation per call); flush gives the last.
    losses.append(pipe.flush(opt))
    assert losses[0] != losses[0]  # NaN
    assert losses[1:] == pytest.approx(ref_losses, abs=1e-12)
    for (name, a), b in zip(pipe.stage.layers.named_parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=name)


def test_stashing_backward_sees_the_forward_weights() -> None:
    # A layer that records the weight it sees: with recompute, the first
    # (no-grad) forward and the recomputation of the same micro-batch must see
    # identical weights under stashing, and (past the first stage's depth)
    # different ones without.
    comm = world()

    class Recorder(nn.Linear):
        seen: list[tuple[bool, torch.Tensor]]

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append((torch.is_grad_enabled(), self.weight.detach().clone()))
            return super().forward(x)

    results = {}
    for stashing in (True, False):
        model, balance = make_model(comm.size)
        rec = Recorder(D, D).double()
        rec.seen = []
        model[0] = rec
        pipe = Pipeline(
            model, balance, chunks=2, schedule="async", weight_stashing=stashing, recompute=True
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=LR)
        for x, y in batches(4, 4):
            pipe.step(x, y, nn.functional.cross_entropy, opt)
        pipe.flush(opt)
        if comm.rank == 0:
            fwd = [w for grad, w in rec.seen if not grad]
            bwd = [w for grad, w in rec.seen if grad]
            assert len(fwd) == len(bwd) == 8
            results[stashing] = [torch.equal(a, b) for a, b in zip(fwd, bwd, strict=True)]
    if comm.rank == 0:
        assert all(results[True])
        depth = comm.size - 1
        assert results[False] == [j == 0 or depth == 0 for j in range(8)]


OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01),
}


@pytest.mark.parametrize("prediction", [None, "msnag", "aggmsnag"])
@pytest.mark.parametrize("gap", [None, "ga", "ga_jfl"])
@pytest.mark.parametrize("stashing", [True, False])
def test_every_combination_runs_and_learns(
    prediction: str | None, gap: str | None, stashing: bool
) -> None:
    comm = world()
    # A deterministic spread of optimizers and recompute over the combinations
    # (the same on every rank).
    i, k = [None, "msnag", "aggmsnag"].index(prediction), [None, "ga", "ga_jfl"].index(gap)
    name = ["sgd", "adam", "adamw"][(i + k + stashing) % 3]
    recompute = (k + stashing) % 2 == 0
    model, balance = make_model(comm.size)
    pipe = Pipeline(
        model,
        balance,
        chunks=2,
        schedule="async",
        weight_stashing=stashing,
        weight_prediction=prediction,
        gap_aware=gap,
        step_every=2,
        recompute=recompute,
    )
    opt = OPTIMIZERS[name](list(pipe.parameters()))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    x, y = batches(1, 16)[0]
    losses = [pipe.step(x, y, nn.functional.cross_entropy, opt, sched) for _ in range(12)]
    losses.append(pipe.flush(opt, sched))
    losses = losses[1:]  # the first call has no earlier loss to report
    assert all(torch.isfinite(p).all() for p in pipe.parameters())
    assert losses[-1] < losses[0], (name, recompute, losses)


def test_async_options_are_checked() -> None:
    model, balance = make_model(world().size)
    with pytest.raises(PipelineError, match="weight_prediction='nag'"):
        Pipeline(model, balance, schedule="async", weight_prediction="nag")
    with pytest.raises(PipelineError, match="gap_aware='gap'"):
        Pipeline(model, balance, schedule="async", gap_aware="gap")
    with pytest.raises(PipelineError, match="step_every=0"):
        Pipeline(model, balance, schedule="async", step_every=0)
    with pytest.raises(PipelineError, match="recompute=True"):
        Pipeline(model, balance, schedule="async", checkpoint="always")


def test_ga_without_stash_under_recompute_is_refused_and_ga_jfl_acts() -> None:
    """issue 33: θ_used is the backward's weights; recomputed without a stash they are
    the current ones, so "ga" measured a gap of 0 and did nothing (|ga − none| = 0).
    It is refused with the fix in the message; "ga_jfl" measures the gap to the
    forward's weights and does damp the steps."""
    model, balance = make_model(world().size)
    with pytest.raises(PipelineError, match="gap_aware='ga_jfl'"):
        Pipeline(
            model, balance, schedule="async", gap_aware="ga", weight_stashing=False, recompute=True
        )
    finals = {}
    for gap in (None, "ga_jfl"):
        model, balance = make_model(world().size)
        pipe = Pipeline(
            model,
            balance,
            chunks=2,
            schedule="async",
            gap_aware=gap,
            weight_stashing=False,
            recompute=True,
        )
        opt = torch.optim.SGD(pipe.parameters(), lr=0.5, momentum=0.9)
        for x, y in batches(6, 8):
            pipe.step(x, y, nn.functional.cross_entropy, opt)
        pipe.flush(opt)
        finals[gap] = [p.detach().clone() for p in pipe.parameters()]
    gaps = max(float((a - b).abs().max()) for a, b in zip(*finals.values(), strict=True))
    # Only stages with a stale gradient (depth > 0) can differ.
    if world().rank < world().size - 1:
        assert gaps > 1e-6


def digits_accuracy(schedule: str, v: int = 1, **options: Any) -> float:
    """Trains a small MLP on digits with ``schedule`` (``v`` chunks per rank); test
    accuracy (on every rank)."""
    from sklearn.datasets import load_digits

    comm = world()
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x / 16.0, dtype=torch.float32)
    y = torch.tensor(y)
    x_train, y_train, x_test, y_test = x[:1400], y[:1400], x[1400:1796], y[1400:1796]
    torch.manual_seed(3)
    layers: list[nn.Module] = [nn.Linear(64, 48), nn.Tanh()]
    if v == 1:
        for _ in range(comm.size - 1):
            layers += [nn.Linear(48, 48), nn.Tanh()]
        layers.append(nn.Linear(48, 10))
        balance = [2] * comm.size
        balance[-1] += 1
    else:
        # The same two hidden layers at any size, cut into comm.size·v chunks
        # (identities where there are more chunks than layers).
        n = comm.size * v
        layers += [nn.Linear(48, 48), nn.Tanh(), nn.Linear(48, 10)]
        layers += [nn.Identity() for _ in range(n - len(layers))]
        balance = [len(layers) // n + (s < len(layers) % n) for s in range(n)]
        options["stages_per_rank"] = v
    pipe = Pipeline(nn.Sequential(*layers), balance, chunks=4, schedule=schedule, **options)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(8):
        order = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(order), 40):
            idx = order[i : i + 40]
            pipe.step(x_train[idx], y_train[idx], nn.functional.cross_entropy, opt)
    pipe.flush(opt)
    out = pipe(x_test)
    acc = torch.zeros(1, dtype=torch.float64)
    if pipe.last:
        assert out is not None
        acc[0] = (out.argmax(1) == y_test).double().mean()
    from mpx.collectives import broadcast

    broadcast(acc, comm.size - 1)
    return float(acc)


def test_async_training_reaches_synchronous_accuracy() -> None:
    sync = digits_accuracy("gpipe")
    # The same mini-batch as gpipe's (step_every = chunks): only staleness differs.
    stale = digits_accuracy("async", weight_prediction="msnag", gap_aware="ga", step_every=4)
    assert sync > 0.85
    assert stale >= sync - 0.02, (sync, stale)


def test_async_with_split_backward_and_chunks_reaches_synchronous_accuracy() -> None:
    """Asynchrony with two chunks per rank and W deferred into the gaps trains the
    deeper model as well as gpipe does (each chunk is a stage as stale as its depth)."""
    sync = digits_accuracy("looped_bfs", v=2)
    stale = digits_accuracy(
        "async", v=2, weight_prediction="msnag", gap_aware="ga", step_every=4, split_backward=True
    )
    assert sync > 0.85
    assert stale >= sync - 0.02, (sync, stale)


def test_async_data_parallel_replicas_average_every_step() -> None:
    # 1 stage x n replicas: each micro-batch step uses the replicas' average
    # gradient, i.e. the gradient of the micro-batches of all replicas together.
    comm = world()
    n, chunks = comm.size, 2
    replica_comm = comm.split(0, comm.rank)
    solo = comm.split(comm.rank)
    assert replica_comm is not None
    assert solo is not None
    model, balance = make_model(1)
    ref, _ = make_model(1)
    pipe = Pipeline(
        model,
        balance,
        comm=solo,
        chunks=chunks,
        schedule="async",
        data_parallel_comm=replica_comm,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.5)
    for x, y in batches(3, 4 * n):
        per = len(x) // n
        mine = slice(comm.rank * per, (comm.rank + 1) * per)
        pipe.step(x[mine], y[mine], nn.functional.cross_entropy, opt)
        parts = [
            (x[r * per : (r + 1) * per].chunk(chunks), y[r * per : (r + 1) * per].chunk(chunks))
            for r in range(n)
        ]
        for j in range(chunks):
            xj = torch.cat([p[0][j] for p in parts])
            yj = torch.cat([p[1][j] for p in parts])
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(xj), yj).backward()
            ref_opt.step()
    pipe.flush(opt)
    for a, b in zip(pipe.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_split_backward_and_chunks_are_async_options() -> None:
    model, balance = make_model(world().size)
    with pytest.raises(PipelineError, match="split_backward"):
        Pipeline(model, balance, schedule="1f1b", split_backward=True)
    with pytest.raises(PipelineError, match="stages_per_rank=2"):
        Pipeline(model, balance, schedule="1f1b", stages_per_rank=2)


def test_async_chunks_refuse_weights_tied_across_ranks() -> None:
    # Each chunk steps alone: copies of a weight tied across ranks would step at
    # different times and drift apart, so the combination is refused on every rank.
    comm = world()
    n = comm.size * 2
    model, balance = make_model(n)
    model[2 * (n - 1)].weight = model[0].weight  # first and last virtual stage
    if comm.size == 1:  # both chunks on this rank: one parameter, nothing to tie
        Pipeline(model, balance, schedule="async", stages_per_rank=2)
        return
    with pytest.raises(PipelineError, match="stages_per_rank=2 steps each chunk on its own"):
        Pipeline(model, balance, schedule="async", stages_per_rank=2)
