"""The split backward read from the autograd graph (:mod:`mpx.pipeline.graph_split`).

A chunk whose weights are used by matrix products only runs its forward as it is;
``I`` then leaves every product's weight gradient for ``W`` as a record, and ``I``
plus ``W`` must give the full backward's gradients (float64, one process). A chunk
with a weight used any other way computes that weight's gradient in ``I`` and runs
its later forwards under the capture mode: the gradients stay exact either way.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mpx.pipeline.deferred import Records, weight_grads
from mpx.pipeline.graph_split import ChunkSplit

WIDTH, HEADS = 8, 2


class Conv1D(nn.Module):
    """transformers' GPT-2 Conv1D: ``torch.addmm(bias, x, weight)``, weight stored (in, out)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.addmm(self.bias, x.reshape(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], self.nf)


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


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(WIDTH, HEADS, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attention(x, x, x, need_weights=False)[0]
        return out


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
