"""A small transformer through every schedule: structured borders, masks, dropout, skips.

The stage borders carry dicts: the residual stream (float, needs a gradient),
a padding mask (bool, none) and the sequence length (a plain int). A ``Trim``
layer cuts each micro-batch to its longest sequence, so border shapes change
from one micro-batch to the next. The embedding is stashed as a skip and
popped by the head (first stage to last: across stage 1 on 3 ranks); the
head may share the embedding's weight (tied across the first and last
stages). Every test splits the same model over ``world().size`` stages; nox
runs the file under 1, 2 and 3 ranks.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Generator
from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import allgather, world
from mpx.pipeline import Pipeline, PipelineRemoteError, pop, skippable, stash
from mpx.pipeline.model.skip import Pop, Stash, tracking

pytestmark = pytest.mark.mpi

V, D, T, HEADS = 11, 8, 6, 2  # vocabulary, width, sequence length, attention heads
BATCH = 8
TOL = 1e-10
LR = 0.1

State = dict[str, Any]


def seed_of(seed: int, microbatch: int, layer: int) -> int:
    # The documented formula, written out again here (not imported).
    return ((seed * 1_000_003 + microbatch) * 1_000_003 + layer) % 2**63


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(V, D)
        self.pos = nn.Parameter(0.1 * torch.randn(T, D))

    def forward(self, batch: State) -> State:
        ids = batch["ids"]
        h = self.tok(ids) + self.pos[: ids.shape[1]]
        return {"h": h, "pad": batch["pad"], "n": ids.shape[1]}


@skippable(stash=["x0"])
class StashingEmbed(Embed):
    def forward(self, batch: State) -> Generator[Stash | Pop, Any, State]:  # type: ignore[override]
        state = super().forward(batch)
        yield stash("x0", state["h"])
        return state


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, dropout=0.1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.drop = nn.Dropout(0.1)

    def forward(self, s: State) -> State:
        h, n = s["h"], s["n"]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        x = self.ln1(h)
        a, _ = self.attn(x, x, x, attn_mask=causal, key_padding_mask=s["pad"], need_weights=False)
        h = h + self.drop(a)
        h = h + self.drop(self.mlp(self.ln2(h)))
        return {**s, "h": h}


class Trim(nn.Module):
    """Cuts the micro-batch to its longest sequence: shapes differ by micro-batch."""

    def forward(self, s: State) -> State:
        n = int((~s["pad"]).sum(1).max())
        return {"h": s["h"][:, :n], "pad": s["pad"][:, :n], "n": n}


class Head(nn.Module):
    def __init__(self, tied: nn.Embedding | None = None) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.out = nn.Linear(D, V, bias=False)
        if tied is not None:
            self.out.weight = tied.weight  # the output projection is the embedding

    def forward(self, s: State) -> tuple[torch.Tensor, torch.Tensor]:
        return self.out(self.ln(s["h"])), s["pad"]


@skippable(pop=["x0"])
class PoppingHead(Head):
    def forward(  # type: ignore[override]
        self, s: State
    ) -> Generator[Stash | Pop, Any, tuple[torch.Tensor, torch.Tensor]]:
        x0 = yield pop("x0")
        n = s["h"].shape[1]
        return super().forward({**s, "h": s["h"] + x0[:, :n]})


def make_model(skip: bool = True, tied: bool = False) -> tuple[nn.Sequential, list[int]]:
    """Six layers, split 6 / 3+3 / 2+2+2 (a Trim ends stage 0 of 2 and starts stage 1 of 3)."""
    torch.manual_seed(1234)
    embed = StashingEmbed() if skip else Embed()
    head = (PoppingHead if skip else Head)(embed.tok if tied else None)
    model = nn.Sequential(embed, Block(), Trim(), Block(), Block(), head).double()
    balance = {1: [6], 2: [3, 3], 3: [2, 2, 2]}[world().size]
    return model, balance


def data(seed: int = 7, size: int = BATCH) -> tuple[State, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (size, T), generator=g)
    lengths = torch.randint(1, T + 1, (size,), generator=g)
    pad = torch.arange(T)[None, :] >= lengths[:, None]
    return {"ids": ids, "pad": pad}, ids.roll(-1, dims=1)


def loss_fn(out: tuple[torch.Tensor, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
    logits, pad = out
    n = logits.shape[1]
    target = target[:, :n].masked_fill(pad, -100)  # no loss on padding
    return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))


def run_layers(layers: list[nn.Module], start: int, x: Any, microbatch: int) -> Any:
    for i, layer in enumerate(layers):
        torch.manual_seed(seed_of(0, microbatch, start + i))
        x = layer(x)
    return x


def run_stage(layers: list[nn.Module], start: int, x: Any, microbatch: int, last: bool) -> Any:
    """One stage of the skip model as the README describes its borders: (output, skips)."""
    main, skips = (x, {}) if start == 0 else (x[0], dict(x[1]))
    with tracking(skips):
        main = run_layers(layers, start, main, microbatch)
    return main if last else (main, skips)


def reference(
    model: nn.Sequential, x: State, y: torch.Tensor, chunks: int, first_microbatch: int = 0
) -> float:
    """The unpartitioned model, micro-batch by micro-batch, with the pipeline's seeds."""
    total = 0.0
    for j in range(chunks):
        xj = {k: v.chunk(chunks)[j] for k, v in x.items()}
        loss = loss_fn(run_layers(list(model), 0, xj, first_microbatch + j), y.chunk(chunks)[j])
        (loss / chunks).backward()
        total += loss.item() / chunks
    return total


def compare_grads(pipe: Pipeline, ref: nn.Sequential) -> None:
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, p in ref[index].named_parameters():
            assert p.grad is not None, (index, name)
            assert mine[name].grad is not None, (index, name)
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=TOL)


SYNC = [
    ("sequential", "never"),
    ("gpipe", "never"),
    ("gpipe", "except_last"),
    ("gpipe", "always"),
    ("1f1b", "never"),
    ("1f1b", "always"),
]


def test_borders_really_change_shape_between_microbatches() -> None:
    # The test data gives micro-batches of different longest sequences.
    x, _ = data()
    longest = [int((~pad).sum(1).max()) for pad in x["pad"].chunk(4)]
    assert len(set(longest)) > 1, longest


@pytest.mark.parametrize(
    ("schedule", "checkpoint", "skip"), [(*s, True) for s in SYNC] + [("1f1b", "always", False)]
)
def test_transformer_gradients_equal_the_unpartitioned_model(
    schedule: str, checkpoint: str, skip: bool
) -> None:
    model, balance = make_model(skip)
    ref, _ = make_model(skip)
    pipe = Pipeline(model, balance, chunks=4, schedule=schedule, checkpoint=checkpoint)
    losses, ref_losses = [], []
    for call in range(2):  # the second call's micro-batches draw other dropout masks
        x, y = data(call)
        losses.append(pipe.step(x, y, loss_fn))
        ref_losses.append(reference(ref, x, y, chunks=4, first_microbatch=4 * call))
    compare_grads(pipe, ref)
    assert losses == pytest.approx(ref_losses, abs=TOL, rel=0)
    # Dropout matters here: without the per-micro-batch seeds the loss differs.
    plain, _ = make_model(skip)
    torch.manual_seed(0)
    x, y = data(0)
    assert abs(loss_fn(plain(x), y).item() - ref_losses[0]) > 1e-6
    # Forward only: the last stage returns the output put back together (of
    # unpadded sequences: micro-batch outputs of other lengths cannot be).
    plain.eval()
    pipe.eval()
    x["pad"] = torch.zeros_like(x["pad"])
    out = pipe(x)
    if pipe.last:
        assert out is not None
        whole = [plain(x_j) for x_j in ({k: v.chunk(4)[j] for k, v in x.items()} for j in range(4))]
        for j, (logits, _) in enumerate(whole):
            n = logits.shape[1]
            torch.testing.assert_close(
                out[0][2 * j : 2 * j + 2, :n], logits.detach(), rtol=0, atol=TOL
            )
    else:
        assert out is None


# -- async: a serial PipeDream simulation ------------------------------------------


def forward_versions(p: int, calls: int, chunks: int) -> list[list[int]]:
    """vf[s][j]: optimizer steps stage s has taken when it runs F(j) (step_every=1)."""
    from mpx.pipeline.schedules.table import async_ops

    vf = [[0] * (calls * chunks) for _ in range(p)]
    for s in range(p):
        f = b = 0
        for c in range(calls):
            for kind, j in async_ops(p - s - 1, f, b, (c + 1) * chunks):
                if kind == "F":
                    vf[s][j] = b
                    f += 1
                else:
                    b += 1
    return vf


def leaves_of(x: Any) -> tuple[Any, list[torch.Tensor]]:
    """A copy of a border with its floating-point tensors as fresh leaves requiring grad."""
    if isinstance(x, torch.Tensor):
        if x.is_floating_point():
            leaf = x.detach().clone().requires_grad_(True)
            return leaf, [leaf]
        return x, []
    if isinstance(x, dict):
        out, leaves = {}, []
        for k, v in x.items():
            out[k], more = leaves_of(v)
            leaves += more
        return out, leaves
    if isinstance(x, tuple):
        parts = [leaves_of(v) for v in x]
        return tuple(p for p, _ in parts), [leaf for _, ls in parts for leaf in ls]
    return x, []


def float_tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x] if x.is_floating_point() else []
    if isinstance(x, dict):
        return [t for v in x.values() for t in float_tensors(v)]
    if isinstance(x, tuple):
        return [t for v in x for t in float_tensors(v)]
    return []


def serial_pipedream(
    model: nn.Sequential,
    balance: list[int],
    batches: list[tuple[State, torch.Tensor]],
    chunks: int,
    stashing: bool,
    recompute: bool,
) -> list[dict[str, torch.Tensor]]:
    """PipeDream semantics run serially: stage s's weights after every backward."""
    p = len(balance)
    bounds = list(itertools.accumulate([0, *balance]))
    stages = [copy.deepcopy(list(model)[bounds[s] : bounds[s + 1]]) for s in range(p)]
    modules = [nn.ModuleList(st) for st in stages]
    history = [[{k: v.clone() for k, v in m.state_dict().items()}] for m in modules]
    micro = [
        ({k: v.chunk(chunks)[j] for k, v in x.items()}, y.chunk(chunks)[j])
        for x, y in batches
        for j in range(chunks)
    ]
    vf = forward_versions(p, len(batches), chunks)
    for j, (x, y) in enumerate(micro):
        borders = [x]
        with torch.no_grad():
            for s in range(p):
                modules[s].load_state_dict(history[s][vf[s][j]])
                borders.append(run_stage(stages[s], bounds[s], borders[-1], j, s == p - 1))
        grads: list[torch.Tensor] = []
        for s in reversed(range(p)):
            version = vf[s][j] if (stashing or not recompute) else j
            modules[s].load_state_dict(history[s][version])
            modules[s].zero_grad()
            inp, leaves = leaves_of(borders[s]) if s > 0 else (borders[s], [])
            out = run_stage(stages[s], bounds[s], inp, j, s == p - 1)
            if s == p - 1:
                loss_fn(out, y).backward()
            else:
                outs = float_tensors(out)
                torch.autograd.backward(outs, grads)
            grads = [
                leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves
            ]
            new = {k: v.clone() for k, v in history[s][j].items()}
            for name, prm in modules[s].named_parameters():
                if prm.grad is not None:
                    new[name] -= LR * prm.grad
            history[s].append(new)
    return [h[-1] for h in history]


@pytest.mark.parametrize(("stashing", "recompute"), [(True, False), (True, True), (False, True)])
def test_async_transformer_equals_the_serial_pipedream_simulation(
    stashing: bool, recompute: bool
) -> None:
    comm = world()
    model, balance = make_model()
    ref_model, _ = make_model()
    calls, chunks = 3, 2
    batches = [data(10 + c, size=4) for c in range(calls)]
    pipe = Pipeline(
        model,
        balance,
        chunks=chunks,
        schedule="async",
        weight_stashing=stashing,
        recompute=recompute,
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    for x, y in batches:
        pipe.step(x, y, loss_fn, opt)
    pipe.flush(opt)
    expected = serial_pipedream(ref_model, balance, batches, chunks, stashing, recompute)
    mine = pipe.stage.layers.state_dict()
    assert mine.keys() == expected[comm.rank].keys()
    for name, value in expected[comm.rank].items():
        torch.testing.assert_close(mine[name], value, rtol=0, atol=TOL, msg=name)
    # The steps moved the weights (a reference that never steps would not match).
    start = nn.ModuleList(list(make_model()[0])[bounds_of(balance, comm.rank)]).state_dict()
    assert any(not torch.equal(mine[k], v) for k, v in start.items())


def bounds_of(balance: list[int], stage: int) -> slice:
    return slice(sum(balance[:stage]), sum(balance[: stage + 1]))


# -- errors ------------------------------------------------------------------------


class Opaque(nn.Module):
    """Returns an object no border carries."""

    def forward(self, s: State) -> object:
        return object()


def test_a_border_that_cannot_travel_raises_on_every_stage() -> None:
    # Before: the first stage raised, the next waited until MPX_TIMEOUT.
    comm = world()
    model, balance = make_model()
    model[balance[0] - 1] = nn.Sequential(model[balance[0] - 1], Opaque())
    pipe = Pipeline(model, balance, chunks=2, schedule="1f1b")
    x, y = data()
    # One rank: the loss meets the object; more: the border refuses it.
    why = "a stage's output.* is a object" if comm.size > 1 else "TypeError"
    with pytest.raises(PipelineRemoteError, match=f"failed on rank 0: .*{why}"):
        pipe.step(x, y, loss_fn)


# -- tied weights: the head's projection is the embedding ---------------------------


def tied_copy(pipe: Pipeline) -> torch.Tensor:
    """This stage's copy of the tied weight (zeros where the stage has none)."""
    layers = pipe.local_layers()
    if 0 in layers:
        return layers[0].get_parameter("tok.weight").detach()
    if 5 in layers:
        return layers[5].get_parameter("out.weight").detach()
    return torch.zeros(V, D, dtype=torch.float64)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_tied_embedding_and_head_train_like_the_unpartitioned_model(schedule: str) -> None:
    # Before: PipelineError "tied weights across stages are not supported".
    model, balance = make_model(tied=True)
    ref, _ = make_model(tied=True)
    assert ref[5].get_parameter("out.weight") is ref[0].get_parameter("tok.weight")
    pipe = Pipeline(model, balance, chunks=2, schedule=schedule)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for call in range(3):
        x, y = data(call)
        loss = pipe.step(x, y, loss_fn, opt)
        ref_opt.zero_grad()
        ref_loss = reference(ref, x, y, chunks=2, first_microbatch=2 * call)
        ref_opt.step()
        assert abs(loss - ref_loss) < TOL
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, p in ref[index].named_parameters():
            torch.testing.assert_close(mine[name].detach(), p.detach(), rtol=0, atol=TOL)


def test_tied_copies_stay_equal_under_async() -> None:
    comm = world()
    model, balance = make_model(tied=True)
    initial = model[0].get_parameter("tok.weight").detach().clone()
    pipe = Pipeline(model, balance, chunks=2, schedule="async", weight_prediction="msnag")
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    for call in range(3):
        x, y = data(call)
        pipe.step(x, y, loss_fn, opt)
    pipe.flush(opt)
    copies = allgather(tied_copy(pipe)[None])
    first, last = copies[0], copies[comm.size - 1]
    torch.testing.assert_close(first, last, rtol=0, atol=TOL)
    assert not torch.allclose(first, initial)  # it trained


class Failing(nn.Module):
    """A Block that raises on micro-batch ``at`` of its next call when armed."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block
        self.armed_at: int | None = None
        self.seen = 0

    def forward(self, s: State) -> State:
        if self.armed_at is not None:
            self.seen += 1
            if self.seen > self.armed_at:
                self.armed_at = None
                raise ValueError("injected failure in a transformer block")
        out: State = self.block(s)
        return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("schedule", "checkpoint"), [("1f1b", "never"), ("gpipe", "always")])
def test_a_failed_call_with_structured_borders_is_undone(schedule: str, checkpoint: str) -> None:
    # Layer 4 (a Block) is on the last stage: it fails in micro-batch 1, while
    # the earlier stages have sent (header and tensors) the next micro-batches.
    # Every stage raises; the links settle; the next call is the reference's.
    model, balance = make_model()
    ref, _ = make_model()
    model[4] = Failing(model[4])
    pipe = Pipeline(model, balance, chunks=4, schedule=schedule, checkpoint=checkpoint)
    x0, y0 = data(0)
    x1, y1 = data(1)
    pipe.step(x0, y0, loss_fn)
    reference(ref, x0, y0, chunks=4)
    trap = pipe.local_layers().get(4)
    if isinstance(trap, Failing):
        trap.armed_at, trap.seen = 1, 0
    with pytest.raises(PipelineRemoteError, match=f"rank {world().size - 1}: .*injected failure"):
        pipe.step(x1, y1, loss_fn)
    loss = pipe.step(x1, y1, loss_fn)
    ref_loss = reference(ref, x1, y1, chunks=4, first_microbatch=4)
    assert abs(loss - ref_loss) < TOL
    for index, layer in pipe.local_layers().items():
        mine = dict((layer.block if isinstance(layer, Failing) else layer).named_parameters())
        for name, p in ref[index].named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=TOL)


@pytest.mark.parametrize(
    ("prediction", "gap", "recompute"),
    [("msnag", "ga", False), ("aggmsnag", "ga_jfl", True), (None, "ga", True)],
)
def test_async_prediction_and_gap_aware_train_the_transformer(
    prediction: str | None, gap: str, recompute: bool
) -> None:
    # Weight prediction and the gap-aware penalty handle the structured
    # borders (leaves per tensor, stashes per parameter) and learn.
    model, balance = make_model()
    pipe = Pipeline(
        model,
        balance,
        chunks=2,
        schedule="async",
        weight_prediction=prediction,
        gap_aware=gap,
        recompute=recompute,
    )
    opt = torch.optim.Adam(pipe.parameters(), lr=0.01)
    x, y = data(3)
    losses = [pipe.step(x, y, loss_fn, opt) for _ in range(12)]
    losses.append(pipe.flush(opt))
    assert all(torch.isfinite(p).all() for p in pipe.parameters())
    assert losses[-1] < losses[1], losses  # losses[0] is NaN: async reports a call late


# -- virtual stages: interleaved, looped, zero bubble, V-shaped --------------------

CHUNKED = [
    ("interleaved_1f1b", "never"),
    ("interleaved_1f1b", "always"),
    ("looped_bfs", "never"),
    ("interleaved_zb", "never"),
    ("interleaved_zb", "except_last"),
    ("zbv", "never"),
    ("zbv", "always"),
    ("dualpipev", "never"),
]


@pytest.mark.parametrize(("schedule", "checkpoint"), CHUNKED)
def test_chunked_schedules_train_like_the_unpartitioned_model(
    schedule: str, checkpoint: str
) -> None:
    """Two chunks per rank (a loop, or a V whose first and last stage are both rank 0's),
    dict borders of changing shapes, the embedding's skip to the head and the tied
    embedding/head: losses, gradients and weights after SGD steps equal the
    unpartitioned model micro-batch by micro-batch (float64, 1e-10)."""
    p = world().size
    chunks = 2 * p  # interleaving needs a multiple of p, DualPipeV at least 2p
    balance = {1: [3, 3], 2: [2, 1, 2, 1], 3: [1] * 6}[p]
    model, _ = make_model(skip=True, tied=True)
    ref, _ = make_model(skip=True, tied=True)
    pipe = Pipeline(
        model, balance, chunks=chunks, schedule=schedule, checkpoint=checkpoint, stages_per_rank=2
    )
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    for call in range(2):
        x, y = data(call, size=2 * chunks)
        loss = pipe.step(x, y, loss_fn, opt)
        ref_opt.zero_grad()
        ref_loss = reference(ref, x, y, chunks=chunks, first_microbatch=chunks * call)
        ref_opt.step()
        assert abs(loss - ref_loss) < TOL, (call, loss, ref_loss)
    compare_grads(pipe, ref)
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, prm in ref[index].named_parameters():
            torch.testing.assert_close(mine[name].detach(), prm.detach(), rtol=0, atol=TOL)


# -- variable shapes: a new sequence length every step, nothing rebuilt -------------


@pytest.mark.parametrize(
    ("schedule", "v"), [("1f1b", None), ("gpipe", None), ("interleaved_zb", 2), ("zbv", 2)]
)
def test_random_sequence_lengths_train_like_the_serial_model(schedule: str, v: int | None) -> None:
    """Every step draws its own sequence length (the same on every rank): the pipeline
    trains on as the serial model does, micro-batch by micro-batch, and sends a full
    border header only when a shape changed (a repeated length sends markers)."""
    p = world().size
    chunks = 2 * p if v else 4
    balance = {1: [3, 3], 2: [2, 1, 2, 1], 3: [1] * 6}[p] if v else make_model()[1]
    model, _ = make_model(skip=True, tied=True)
    ref, _ = make_model(skip=True, tied=True)
    pipe = Pipeline(model, balance, chunks=chunks, schedule=schedule, stages_per_rank=v)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    g = torch.Generator().manual_seed(3)
    lengths = [int(n) for n in torch.randint(2, T + 1, (5,), generator=g)] + [T, T]
    boxes = pipe._passes.act_out.values()
    for call, n in enumerate(lengths):
        ids = torch.randint(0, V, (2 * chunks, n), generator=g)
        pad = torch.zeros(2 * chunks, n, dtype=torch.bool)  # Trim keeps every length n
        x, y = {"ids": ids, "pad": pad}, ids.roll(-1, dims=1)
        before = sum(box.full_headers for box in boxes)
        loss = pipe.step(x, y, loss_fn, opt)
        ref_opt.zero_grad()
        ref_loss = reference(ref, x, y, chunks=chunks, first_microbatch=chunks * call)
        ref_opt.step()
        assert abs(loss - ref_loss) < TOL, (call, n, loss, ref_loss)
        if call == len(lengths) - 1:  # the same length again: markers only
            assert sum(box.full_headers for box in boxes) == before
        elif boxes and lengths[call - 1 : call] != [n]:
            assert sum(box.full_headers for box in boxes) > before
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, prm in ref[index].named_parameters():
            torch.testing.assert_close(mine[name].detach(), prm.detach(), rtol=0, atol=TOL)
