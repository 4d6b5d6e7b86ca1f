"""The split backward of chunks whose weights are not nn.Linear layers.

A GPT-2-like model written here (transformers' ``Conv1D``: ``torch.addmm(bias,
x, weight)``), with ``nn.MultiheadAttention``, a 2-D convolution, bare
``nn.Parameter`` weights (a scale, a matrix, one used twice) and the word
embedding tied to the output layer. Its split backward (``I`` then ``W``) must
give the gradients of the whole model's full backward (float64), with every
``W`` working from small records: no chunk keeps its graph from ``I`` to ``W``
(before, every chunk with a weight other than an ``nn.Linear`` did, see
:mod:`mpx.pipeline.retained`), and what a Conv1D chunk keeps for ``W`` is its
products' inputs and output gradients, byte for byte.
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpx.collectives import world
from mpx.pipeline import Pipeline
from mpx.pipeline.deferred import held_bytes

pytestmark = pytest.mark.mpi

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


@pytest.mark.parametrize("schedule", ["interleaved_zb", "zbv"])
def test_split_of_any_weight_equals_the_full_backward_from_records(schedule: str) -> None:
    comm = world()
    chunks = 2 * comm.size
    pipe = Pipeline(
        model(), balance(2 * comm.size), chunks=chunks, schedule=schedule, stages_per_rank=2
    )
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


def test_a_compiled_chunk_splits_from_records_too() -> None:
    # torch.compile'd blocks: the graph holds one compiled node, not the
    # products (mpx.pipeline.graph_split), so a chunk's first I computes its
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
