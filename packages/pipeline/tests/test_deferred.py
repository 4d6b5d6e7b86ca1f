"""The split backward's memory: ``I`` frees the graph, ``W`` keeps only what it needs.

Between a micro-batch's ``I`` and its ``W`` a zero-bubble schedule runs other
passes; whatever the micro-batch keeps meanwhile adds to the rank's peak.
``W`` needs, per Linear call, its input and its output's gradient, nothing of
the autograd graph (the paper's W). These tests count the tensors saved for
backward that are still alive when ``W`` starts, and the bytes the records keep.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.pipeline import Pipeline
from mpx.pipeline.split_backward.capture import capturing
from mpx.pipeline.split_backward.deferred import Records, held_bytes, weight_grads

pytestmark = pytest.mark.mpi

WIDTH, BLOCKS, ROWS, CHUNKS = 16, 4, 6, 4


def block() -> nn.Sequential:
    # Every op after the Linear saves a tensor of its own for its backward
    # (GELU its input, LayerNorm its input and statistics, Tanh its output).
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.LayerNorm(WIDTH), nn.Tanh())


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[block() for _ in range(BLOCKS)]).double()


class SavedByMicrobatch:
    """Tensors saved for backward that are still alive, per (stage, micro-batch) of the forward."""

    def __init__(self) -> None:
        self.tag: tuple[int, int] | None = None
        self.alive: dict[tuple[int, int], int] = {}

    def pack(self, t: torch.Tensor) -> Any:
        if self.tag is None or isinstance(t, nn.Parameter):
            return t
        tag = self.tag
        holder = _Holder(t)
        self.alive[tag] = self.alive.get(tag, 0) + 1
        weakref.finalize(holder, self._drop, tag)
        return holder

    def _drop(self, tag: tuple[int, int]) -> None:
        self.alive[tag] -= 1

    @staticmethod
    def unpack(h: Any) -> Any:
        return h.t if isinstance(h, _Holder) else h


class _Holder:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


def solo_pipeline(schedule: str) -> Pipeline:
    comm = world()
    solo = comm.split(comm.rank)
    assert solo is not None
    return Pipeline(
        model(), [BLOCKS // 2] * 2, comm=solo, chunks=CHUNKS, schedule=schedule,
        stages_per_rank=2,
    )  # fmt: skip


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(CHUNKS * ROWS, WIDTH, dtype=torch.float64, generator=g)
    return x.requires_grad_(True), torch.randn(CHUNKS * ROWS, WIDTH, dtype=torch.float64)


def test_w_finds_the_graph_of_its_microbatch_freed_and_keeps_only_linear_inputs() -> None:
    # Before: I ran with retain_graph=True and W differentiated the kept graph,
    # so every tensor the micro-batch's forward saved (the GELU, LayerNorm and
    # Tanh ones too) was alive until its W.
    pipe = solo_pipeline("interleaved_zb")
    passes = pipe._passes
    saved = SavedByMicrobatch()
    at_w: list[tuple[int, int, int]] = []  # (saved tensors alive, bytes kept, bytes needed)
    forward, weight_grad = passes.forward, passes.weight_grad

    def tagged_forward(j: int, mb: Any, *args: Any) -> None:
        saved.tag = (mb.stage, j)
        try:
            forward(j, mb, *args)
        finally:
            saved.tag = None

    def checked_weight_grad(j: int, mb: Any, *rest: Any) -> None:
        # Per Linear call of the chunk: its input and output gradient, ROWS x WIDTH each.
        needed = (BLOCKS // 2) * 2 * ROWS * WIDTH * 8
        at_w.append((saved.alive[(mb.stage, j)], held_bytes(mb.records), needed))
        weight_grad(j, mb, *rest)

    setattr(passes, "forward", tagged_forward)  # noqa: B010 (mypy: a method replaced)
    setattr(passes, "weight_grad", checked_weight_grad)  # noqa: B010
    x, y = batch()
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        pipe.step(x, y, nn.functional.mse_loss)
    assert len(at_w) == 2 * CHUNKS  # a W per micro-batch and chunk
    for alive, kept, needed in at_w:
        assert alive == 0
        assert kept == needed
    assert pipe.deferred_bytes == 0  # every W ran


def test_split_backward_gradients_equal_the_full_backward() -> None:
    x, y = batch()
    grads = []
    for schedule in ("interleaved_1f1b", "interleaved_zb"):
        pipe = solo_pipeline(schedule)
        pipe.step(x, y, nn.functional.mse_loss)
        grads.append([p.grad for p in pipe.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def recorded(layers: nn.Module, run: Callable[[], torch.Tensor]) -> tuple[Records, torch.Tensor]:
    records = Records()
    with capturing(layers.parameters(), records):
        out = run()
    return records, out


def test_a_weight_shared_by_a_linear_and_another_op_gets_both_parts() -> None:
    # A Linear's weight used again outside the layer (a tied embedding does
    # this): the Linear's part comes from W, the other use's part from I.
    torch.manual_seed(0)
    lin = nn.Linear(5, 5).double()
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)

    def run() -> torch.Tensor:
        out: torch.Tensor = (lin(lin(x)) * lin.weight.sum()).sum()
        return out

    records, out = recorded(lin, run)
    out.backward()
    assert len(records) == 2
    assert x.grad is not None
    partial = lin.weight.grad.clone()  # type: ignore[union-attr]
    weight_grads(records)
    assert records.held.bytes == 0
    assert not records
    ref = nn.Linear(5, 5).double()
    ref.load_state_dict(lin.state_dict())
    xr = x.detach().clone().requires_grad_(True)
    (ref(ref(xr)) * ref.weight.sum()).sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=1e-12)
    assert ref.weight.grad is not None
    assert not torch.allclose(partial, ref.weight.grad)  # W's part was still owed


def test_frozen_and_no_grad_linears_are_not_recorded() -> None:
    lin = nn.Linear(4, 4).double().requires_grad_(False)
    x = torch.randn(2, 4, dtype=torch.float64, requires_grad=True)
    records, out = recorded(lin, lambda: lin(x).pow(2).sum())
    out.backward()
    assert not records
    assert x.grad is not None
    trained = nn.Linear(4, 4).double()
    with torch.no_grad():
        records, out = recorded(trained, lambda: trained(x))
    out.sum()
    assert not records
    assert not out.requires_grad


class OwnParameter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class OwnLinearForward(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * 2


def test_weights_of_any_kind_are_found_from_the_calls_that_take_them() -> None:
    # Before, only nn.Linear layers recorded; a chunk with any other weight
    # kept its whole graph for W (mpx.pipeline.split_backward.retained). Now every call taking
    # a weight of 2+ dimensions records: products as (input, grad) pairs, the
    # rest as their own small graphs; 1-D weights (a scale, a norm) stay in I.
    x = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)

    def kinds(layer: nn.Module, inp: torch.Tensor = x) -> tuple[int, int]:
        layer = layer.double()
        records, out = recorded(layer, lambda: layer(inp).sum())
        out.backward()
        found = (len(records), len(records.ops))
        weight_grads(records)
        return found

    assert kinds(OwnLinearForward(4, 4)) == (1, 0)
    assert kinds(nn.Conv1d(3, 2, 3)) == (0, 1)
    assert kinds(OwnParameter()) == (0, 0)  # 1-D: its gradient in I
    assert kinds(OwnParameter().requires_grad_(False)) == (0, 0)
    assert kinds(nn.Embedding(3, 4), torch.tensor([0, 2])) == (0, 0)  # a lookup: in I
    attention = nn.MultiheadAttention(4, 2, batch_first=True).double()
    assert kinds(MultiheadSelf(attention)) == (2, 0)  # its two projections


class MultiheadSelf(nn.Module):
    def __init__(self, attention: nn.MultiheadAttention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.attention(x, x, x, need_weights=False)[0]
        return out


def test_a_full_backward_in_a_split_call_does_not_record() -> None:
    # DualPipeV mixes full backwards (B) with split ones (I, W) in one call: the
    # forwards of the B ones need no records (recording then multiplying them
    # in B would only add Python per Linear call).
    pipe = solo_pipeline("dualpipev")
    passes = pipe._passes
    kinds: dict[str, list[bool]] = {"B": [], "I": []}
    backward, input_grad = passes.backward, passes.input_grad

    def watched_backward(j: int, mb: Any, *rest: Any) -> None:
        kinds["B"].append(mb.capture)
        backward(j, mb, *rest)

    def watched_input_grad(j: int, mb: Any, *rest: Any) -> None:
        kinds["I"].append(mb.capture)
        input_grad(j, mb, *rest)

    setattr(passes, "backward", watched_backward)  # noqa: B010
    setattr(passes, "input_grad", watched_input_grad)  # noqa: B010
    x, y = batch()
    pipe.step(x, y, nn.functional.mse_loss)
    assert kinds["B"]
    assert not any(kinds["B"])
    assert kinds["I"]
    assert all(kinds["I"])
