"""The split backward of chunks whose weights are not nn.Linear layers.

A GPT-2-like model written here (transformers' ``Conv1D``: ``torch.addmm(bias,
x, weight)``), with ``nn.MultiheadAttention``, a 2-D convolution, bare
``nn.Parameter`` weights (a scale, a matrix, one used twice) and the word
embedding tied to the output layer. Its split backward (``I`` then ``W``) must
give the gradients of the whole model's full backward (float64), with every
``W`` working from small records: no chunk keeps its graph from ``I`` to ``W``
(before, every chunk with a weight other than an ``nn.Linear`` did, see
:mod:`mpx.pipeline.split_backward.retained`), and what a Conv1D chunk keeps for ``W`` is its
products' inputs and output gradients, byte for byte.

One process, no pipeline (:mod:`mpx.pipeline.split_backward.graph_split`): a chunk whose weights
are used by matrix products only runs its forward as it is, ``I`` leaves every
product's weight gradient for ``W`` as a record, and ``I`` plus ``W`` give the full
backward's gradients; a chunk with a weight used any other way computes that
weight's gradient in ``I`` and captures from its next forward on, exactly too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpx.collectives import world
from mpx.pipeline import Pipeline
from mpx.pipeline.split_backward.deferred import Records, held_bytes, weight_grads
from mpx.pipeline.split_backward.graph_split import ChunkSplit

VOCAB, WIDTH, HEADS, LENGTH = 11, 8, 2, 6
TOL = 1e-13


class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: a linear map with the weight stored transposed."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class GPT2Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.c_attn, self.c_proj = Conv1D(3 * WIDTH, WIDTH), Conv1D(WIDTH, WIDTH)
        self.c_fc, self.mlp_proj = Conv1D(4 * WIDTH, WIDTH), Conv1D(WIDTH, 4 * WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = (
            z.view(b, t, HEADS, w // HEADS).transpose(1, 2)
            for z in self.c_attn(self.ln_1(x)).split(w, dim=2)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(att.transpose(1, 2).reshape(b, t, w))
        out: torch.Tensor = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))
        return out


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.token = nn.Embedding(VOCAB, WIDTH)
        self.position = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)  # bare, sliced

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.token(ids) + self.position[: ids.shape[1]]
        return out


class Head(nn.Module):
    """The output layer, its weight the word embedding's (tied)."""

    def __init__(self, embed: Embed) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.weight = embed.token.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(x), self.weight)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        keep = torch.zeros(x.shape[:2], dtype=torch.bool)  # a padding mask, by keyword
        out: torch.Tensor = (
            x + self.attention(h, h, h, key_padding_mask=keep, need_weights=False)[0]
        )
        return out


class Convolution(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.conv(x.unsqueeze(1))).sum(1)


class BareWeights(nn.Module):
    """Bare parameters: a 1-D scale, and a matrix used twice (``x @ W``, then again)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(WIDTH))
        self.matrix = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.matrix) * self.scale
        return x + torch.tanh(h @ self.matrix)


def model() -> nn.Sequential:
    torch.manual_seed(0)
    embed = Embed()
    layers: list[nn.Module] = [embed, GPT2Block(), Attention(), Convolution(), BareWeights()]
    layers += [GPT2Block(), Attention(), GPT2Block(), Convolution(), BareWeights(), GPT2Block()]
    return nn.Sequential(*layers, Head(embed)).double()


def balance(stages: int) -> list[int]:
    n = len(model())
    return [n // stages + (1 if s < n % stages else 0) for s in range(stages)]


def batch(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2 * chunks, LENGTH), generator=g)
    return ids, torch.randint(0, VOCAB, (2 * chunks, LENGTH), generator=g)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def two_chunks_a_rank(schedule: str) -> tuple[Pipeline, int]:
    """The model on every rank's two chunks under ``schedule``, and its chunks (2 a rank)."""
    ranks = world().size
    pipe = Pipeline(
        model(), balance(2 * ranks), chunks=2 * ranks, schedule=schedule, stages_per_rank=2
    )
    return pipe, 2 * ranks


@pytest.mark.mpi
@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_split_of_any_weight_equals_the_full_backward_from_records(schedule: str) -> None:
    pipe, chunks = two_chunks_a_rank(schedule)
    passes = pipe._passes
    seen: list[tuple[bool, bool]] = []  # per W: records left by I, graph kept
    weight_grad = passes.weight_grad

    def watched(j: int, mb: Any, *rest: Any) -> None:
        seen.append((bool(mb.records), mb.kept is not None))
        weight_grad(j, mb, *rest)

    setattr(passes, "weight_grad", watched)  # noqa: B010 (mypy: a method replaced)
    ids, target = batch(chunks)
    loss = pipe.step(ids, target, loss_fn)

    ref = model()
    ref_loss = loss_fn(ref(ids), target)
    ref_loss.backward()
    assert abs(loss - ref_loss.item()) < TOL
    checked = 0
    for index, layer in pipe.local_layers().items():
        mine = dict(layer.named_parameters())
        for name, p in ref[index].named_parameters():
            assert mine[name].grad is not None, (index, name)
            torch.testing.assert_close(mine[name].grad, p.grad, rtol=0, atol=TOL)
            checked += 1
    assert checked > 0
    # Every W worked from records (every chunk holds a weight of 2+ dimensions
    # used in a product or another call), none from a kept graph.
    assert len(seen) == chunks * len(passes.stages)
    for records, kept in seen:
        assert records
        assert not kept
    assert pipe.deferred_bytes == 0


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_training_steps_of_the_split_equal_the_whole_models(schedule: str) -> None:
    # From the second step on, chunks with a convolution or a weight used twice run
    # under the capture mode, the others from the graph: four SGD steps with momentum
    # (the batch changing every step) must stay the whole model's, weights and losses.
    pipe, chunks = two_chunks_a_rank(schedule)
    ref = model()
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(4):
        ids, target = batch(chunks)
        ids = (ids + step) % VOCAB
        loss = pipe.step(ids, target, loss_fn, opt)
        ref_opt.zero_grad()
        ref_loss = loss_fn(ref(ids), target)
        ref_loss.backward()
        ref_opt.step()
        assert abs(loss - ref_loss.item()) < 1e-12, step
        for index, layer in pipe.local_layers().items():
            mine = dict(layer.named_parameters())
            for name, p in ref[index].named_parameters():
                torch.testing.assert_close(mine[name], p, rtol=0, atol=1e-12)


@pytest.mark.mpi
def test_a_conv1d_chunk_keeps_its_products_inputs_and_output_gradients_for_w() -> None:
    # Two chunks of GPT-2 blocks on one rank. Per block and micro-batch W needs,
    # for each of its four Conv1D products, the input and the output's gradient:
    # c_attn (rows x WIDTH, rows x 3 WIDTH), c_proj (WIDTH, WIDTH), c_fc (WIDTH,
    # 4 WIDTH), the MLP's projection (4 WIDTH, WIDTH): 16 WIDTH values a row.
    # Before, the chunk kept its whole graph (attention, GELU, LayerNorm) to W.
    comm = world()
    solo = comm.split(comm.rank)
    assert solo is not None
    blocks, chunks = 2, 4
    torch.manual_seed(0)
    net = nn.Sequential(*[GPT2Block() for _ in range(2 * blocks)]).double()
    pipe = Pipeline(
        net, [blocks, blocks], comm=solo, chunks=chunks, schedule="interleaved_zb",
        stages_per_rank=2,
    )  # fmt: skip
    rows = 2 * LENGTH  # two sequences a micro-batch
    needed = blocks * 16 * WIDTH * rows * 8
    at_w: list[tuple[int, int, bool]] = []
    passes = pipe._passes
    weight_grad = passes.weight_grad

    def checked(j: int, mb: Any, *rest: Any) -> None:
        at_w.append((held_bytes(mb.records), mb.records.bytes, mb.kept is not None))
        weight_grad(j, mb, *rest)

    setattr(passes, "weight_grad", checked)  # noqa: B010
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2 * chunks, LENGTH, WIDTH, dtype=torch.float64, generator=g)
    pipe.step(x, torch.zeros_like(x), F.mse_loss)
    assert len(at_w) == 2 * chunks
    for held, counted, kept in at_w:
        assert held == needed
        assert counted == needed
        assert not kept
    assert pipe.deferred_bytes == 0


@pytest.mark.mpi
def test_a_compiled_chunk_splits_from_records_too() -> None:
    # torch.compile'd blocks: the graph holds one compiled node, not the
    # products (mpx.pipeline.split_backward.graph_split), so a chunk's first I computes its
    # weights' gradients itself and its later forwards capture: dynamo hands
    # the calls to the handler (graph breaks), which records as in eager mode.
    # Before, the Conv1D chunk kept its graph.
    comm = world()
    solo = comm.split(comm.rank)
    assert solo is not None
    torch.manual_seed(0)
    blocks = [GPT2Block().double() for _ in range(2)]
    ref = nn.Sequential(*[GPT2Block().double() for _ in range(2)])
    ref.load_state_dict(nn.Sequential(*blocks).state_dict())
    compiled = nn.Sequential(
        *[cast(nn.Module, torch.compile(b, backend="aot_eager")) for b in blocks]
    )
    pipe = Pipeline(
        compiled, [1, 1], comm=solo, chunks=2, schedule="interleaved_zb", stages_per_rank=2
    )
    seen: list[tuple[bool, bool]] = []
    passes = pipe._passes
    weight_grad = passes.weight_grad

    def watched(j: int, mb: Any, *rest: Any) -> None:
        seen.append((bool(mb.records), mb.kept is not None))
        weight_grad(j, mb, *rest)

    setattr(passes, "weight_grad", watched)  # noqa: B010
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, LENGTH, WIDTH, dtype=torch.float64, generator=g)
    y = torch.randn(4, LENGTH, WIDTH, dtype=torch.float64, generator=g)
    for step in range(2):
        seen.clear()
        for module in (*blocks, ref):
            module.zero_grad()
        pipe.step(x, y, F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        for mine, theirs in zip(blocks, ref, strict=True):
            for p, q in zip(mine.parameters(), theirs.parameters(), strict=True):
                assert p.grad is not None
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=TOL)
        # Step 1: each chunk's first micro-batch found the compiled node (its W
        # has nothing left to do), its second captured; from then on, all capture.
        expected = [(False, False), (True, False)] * 2 if step == 0 else [(True, False)] * 4
        assert sorted(seen) == sorted(expected)


class Offset(nn.Module):
    """``tanh(x) + W``, ``W`` of a micro-batch's output shape: its gradient is the output's
    gradient itself (autograd's add passes it through, no copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1, WIDTH) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) + self.weight


@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_a_weight_whose_gradient_is_the_received_gradient_is_right_every_step(
    schedule: str,
) -> None:
    # A chunk ending in an Offset has the next stage's gradient message as its
    # weight's gradient; from its second micro-batch on the chunk captures, and W
    # took that tensor as the weight's .grad: a pooled receive buffer, refilled by
    # the next message. The second step's gradients came out wrong so (by 1-4 %).
    comm = world()
    stages = 2 * comm.size
    chunks = 2 * comm.size
    torch.manual_seed(0)
    layers = [Offset() for _ in range(stages)]
    ref = nn.Sequential(*[Offset() for _ in range(stages)]).double()
    ref.load_state_dict(nn.Sequential(*layers).state_dict())
    pipe = Pipeline(
        nn.Sequential(*layers).double(),
        [1] * stages,
        chunks=chunks,
        schedule=schedule,
        stages_per_rank=2,
    )
    g = torch.Generator().manual_seed(4)
    x = torch.randn(chunks, WIDTH, dtype=torch.float64, generator=g)  # one row a micro-batch
    y = torch.randn(chunks, WIDTH, dtype=torch.float64, generator=g)
    for _ in range(3):
        pipe.zero_grad()
        ref.zero_grad()
        pipe.step(x, y, F.mse_loss)
        F.mse_loss(ref(x), y).backward()
        for index, layer in pipe.local_layers().items():
            assert layer.weight.grad is not None
            torch.testing.assert_close(layer.weight.grad, ref[index].weight.grad, rtol=0, atol=TOL)


# -- the split read from the graph, one process ------------------------------------


class Tied(nn.Module):
    """One bare matrix used by two products (``x @ W``)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.weight) @ self.weight


class Transposed(nn.Module):
    """``x @ W.T`` and ``x @ W.transpose(0, 1)``: transposes written out, not ``F.linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(16, WIDTH) * 0.3)
        self.second = nn.Parameter(torch.randn(WIDTH, 16) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.first.T) @ self.second.transpose(0, 1)


class Regularised(nn.Module):
    """A Linear layer whose weight is also used on its own (its sum): not a product only."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.linear(x) + self.linear.weight.sum()
        return out


class Scaled(nn.Module):
    """``addmm`` with ``alpha``: the weight's gradient needs the scale."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) * 0.3)
        self.bias = nn.Parameter(torch.randn(WIDTH) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, WIDTH), self.weight, alpha=2.0)


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, WIDTH, bias=False))


def _first_stage() -> nn.Module:
    # A first chunk's input needs no gradient: its first product runs in I for
    # nothing but its output's gradient, which W needs.
    return nn.Sequential(nn.Linear(WIDTH, 16, bias=False), nn.Tanh(), nn.Linear(16, WIDTH))


def _conv() -> nn.Module:
    return nn.Sequential(nn.Conv1d(5, 5, 3, padding=1), nn.Tanh())  # (batch, 5 channels, WIDTH)


# name -> (chunk, products per forward, whether the input needs a gradient)
GRAPH_CASES: dict[str, tuple[Callable[[], nn.Module], int, bool]] = {
    "gpt2_conv1d_block": (GPT2Block, 4, True),
    "linear_mlp": (_mlp, 2, True),
    "first_stage_linear": (_first_stage, 2, False),
    "matrix_used_twice": (Tied, 2, True),
    "transposes_written_out": (Transposed, 2, True),
    "multihead_attention": (Attention, 2, True),
}


def _full(chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor, needs: bool) -> list[torch.Tensor]:
    chunk.zero_grad(set_to_none=True)
    xr = x.clone().requires_grad_(needs)
    chunk(xr).backward(grad)
    found = [p.grad.clone() for p in chunk.parameters() if p.grad is not None]
    return [*found, xr.grad.clone()] if needs and xr.grad is not None else found


def _split(
    split: ChunkSplit, chunk: nn.Module, x: torch.Tensor, grad: torch.Tensor, needs: bool
) -> tuple[list[torch.Tensor], Records, list[bool]]:
    """I then W; also the records I left and which weights had no gradient after I."""
    chunk.zero_grad(set_to_none=True)
    params = list(chunk.parameters())
    xr = x.clone().requires_grad_(needs)
    records = Records()
    with split.forward(params, records):
        out = chunk(xr)
    split.input_backward([out], [grad], records)
    left = [p.grad is None for p in params]
    kept = Records()
    kept.extend(records)
    kept.ops.extend(records.ops)
    kept.captured, kept.bytes = records.captured, records.bytes
    weight_grads(records)
    found = [p.grad.clone() for p in params if p.grad is not None]
    return ([*found, xr.grad.clone()] if needs and xr.grad is not None else found), kept, left


def _inputs(chunk: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 5, WIDTH, dtype=torch.float64)
    with torch.no_grad():
        grad = torch.randn_like(chunk(x))
    return x, grad


@pytest.mark.parametrize("name", sorted(GRAPH_CASES))
def test_products_are_left_for_w_from_the_graph_and_the_gradients_are_the_full_backwards(
    name: str,
) -> None:
    make, products, needs = GRAPH_CASES[name]
    torch.manual_seed(0)
    chunk = make().double()
    split = ChunkSplit()
    for _ in range(2):  # the second micro-batch takes the same path
        x, grad = _inputs(chunk)
        expected = _full(chunk, x, grad, needs)
        got, records, left = _split(split, chunk, x, grad, needs)
        assert not split.captures  # products only: no capture mode, ever
        assert not records.captured
        assert not records.ops
        assert len(records) == products
        # Each deferred weight had no gradient after I: W gave it, from its record.
        deferred = {id(w) for _, _, w, _, _ in records}
        params = list(chunk.parameters())
        assert deferred
        assert all(left[i] for i, p in enumerate(params) if id(p) in deferred)
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_a_record_holds_the_products_input_and_output_gradient() -> None:
    torch.manual_seed(1)
    chunk = nn.Linear(WIDTH, 4, bias=False).double()
    x = torch.randn(6, WIDTH, dtype=torch.float64)
    grad = torch.randn(6, 4, dtype=torch.float64)
    _, records, _ = _split(ChunkSplit(), chunk, x, grad, True)
    ((kept_x, kept_grad, weight, bias, transposed),) = records
    assert torch.equal(kept_x, x)
    assert torch.equal(kept_grad, grad)
    assert weight is chunk.weight
    assert bias is None
    assert not transposed
    assert records.bytes == x.nbytes + grad.nbytes


@pytest.mark.parametrize("make", [_conv, Regularised, Scaled], ids=["conv", "sum", "alpha"])
def test_a_weight_used_otherwise_gets_its_gradient_in_i_then_the_chunk_captures(
    make: Callable[[], nn.Module],
) -> None:
    torch.manual_seed(2)
    chunk = make().double()
    split = ChunkSplit()
    x, grad = _inputs(chunk)
    expected = _full(chunk, x, grad, True)
    got, records, _ = _split(split, chunk, x, grad, True)
    # The first micro-batch: that weight's whole gradient came from I (exact)...
    assert not records.captured
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    # ...and the chunk's later forwards capture, which defers what the graph could not.
    assert split.captures
    x, grad = _inputs(chunk)
    expected = _full(chunk, x, grad, True)
    got, records, _ = _split(split, chunk, x, grad, True)
    assert records.captured
    assert records or records.ops
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_a_chunk_without_weights_runs_a_plain_backward() -> None:
    chunk = nn.Tanh()
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    grad = torch.randn(4, WIDTH, dtype=torch.float64)
    got, records, _ = _split(ChunkSplit(), chunk, x, grad, True)
    assert not records
    torch.testing.assert_close(got[0], grad * (1 - torch.tanh(x) ** 2), rtol=0, atol=1e-15)
