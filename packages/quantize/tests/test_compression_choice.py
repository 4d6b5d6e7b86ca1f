"""``CompressionConfig(when="auto")``: compression only where it was measured faster.

The decision's inputs are timings, so the tests pin what does not depend on
them: every rank decides the same, a buffer that is not compressed is the plain
allreduce bit for bit, one that is gets exactly the bits ``when="always"`` gives
it (the measurement leaves the state's generator, residuals and counters alone),
and ranks that disagree on ``when`` get an error. ``MARGIN`` forces either
decision while the real measurement still runs. Run under mpxrun -n 1, 2, 3.
"""

from __future__ import annotations

import pytest
import torch

import mpx.collectives as mc
import mpx.quantize as mq
from mpx.quantize import compression_choice

pytestmark = pytest.mark.mpi

N = 1 << 14


def _grads(comm: mc.Communicator, n: int = N) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 + comm.rank)
    return torch.randn(n, generator=generator)


def _reduced(
    config: mq.CompressionConfig, x: torch.Tensor
) -> tuple[torch.Tensor, mq.QuantizeState]:
    comm = mc.world()
    state = mq.QuantizeState(config, comm)
    out = x.clone()
    for _ in range(2):  # the second call reuses the decision (and the residuals)
        mq.allreduce(out, comm, config=config, op="avg", state=state)
    return out, state


def test_every_rank_takes_the_same_path_and_keeps_it() -> None:
    comm = mc.world()
    _, state = _reduced(mq.CompressionConfig(bits=4, when="auto"), _grads(comm))
    if comm.size == 1:
        assert state.choices == {}  # one rank: nothing to reduce, nothing measured
        return
    (choice,) = state.choices.values()
    assert (N, torch.float32, "cpu", "avg") in state.choices
    assert choice.plain_s > 0
    assert choice.compressed_s > 0
    row = torch.tensor(
        [choice.compressed, choice.plain_s, choice.compressed_s], dtype=torch.float64
    )
    every = mc.allgather(row.unsqueeze(0), comm=comm)
    assert torch.equal(every, row.expand_as(every)), every


@pytest.mark.parametrize("error_feedback", [False, True])
def test_forced_compression_gives_the_bits_of_always(
    monkeypatch: pytest.MonkeyPatch, error_feedback: bool
) -> None:
    monkeypatch.setattr(compression_choice, "MARGIN", -1e12)  # compressed wins any timing
    x = _grads(mc.world())
    config = mq.CompressionConfig(bits=4, error_feedback=error_feedback, stochastic=True)
    always, always_state = _reduced(config, x)
    auto, auto_state = _reduced(config.with_(when="auto"), x)
    assert torch.equal(auto, always)
    assert auto_state.bytes_sent == always_state.bytes_sent
    # Keyed by the buffer's address (each run's own): compared in order.
    assert len(auto_state.residuals) == len(always_state.residuals)
    for mine, theirs in zip(
        auto_state.residuals.values(), always_state.residuals.values(), strict=True
    ):
        assert torch.equal(mine, theirs)
    if mc.world().size > 1:
        assert all(choice.compressed for choice in auto_state.choices.values())
        assert not torch.equal(auto, x)  # quantized: not the plain average either


def test_a_plain_choice_is_the_plain_allreduce_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compression_choice, "MARGIN", 1.0)  # compressed never wins
    comm = mc.world()
    x = _grads(comm)
    auto, state = _reduced(mq.CompressionConfig(bits=4, when="auto"), x)
    plain = x.clone()
    for _ in range(2):
        mc.allreduce(plain, "avg", comm=comm)
    assert torch.equal(auto, plain)
    assert state.bytes_sent == state.bytes_uncompressed
    assert not any(choice.compressed for choice in state.choices.values())


def test_allreduce_tensors_decides_per_fused_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compression_choice, "MARGIN", 1.0)
    comm = mc.world()
    grads = [_grads(comm, N).view(128, -1), _grads(comm, 100)]  # a matrix, and a 1-D bias
    expected = [g.clone() for g in grads]
    for g in expected:
        mc.allreduce(g, "avg", comm=comm)
    state = mq.QuantizeState(mq.CompressionConfig(bits=4, when="auto"), comm)
    mq.allreduce_tensors(grads, comm, state.config, "avg", names=["w", "b"], state=state)
    for got, want in zip(grads, expected, strict=True):
        assert torch.equal(got, want)
    # Only the compressible buffer was measured; the bias was never a candidate.
    assert len(state.choices) == (1 if comm.size > 1 else 0)


def test_ranks_that_disagree_on_when_fail_on_every_rank() -> None:
    comm = mc.world()
    if comm.size == 1:
        pytest.skip("needs 2 or more ranks to disagree")
    when = "auto" if comm.rank == 0 else "always"
    with pytest.raises(mc.MismatchError, match="when: rank 0 passed 'auto', rank 1 'always'"):
        _reduced(mq.CompressionConfig(bits=4, when=when), _grads(comm))


@pytest.mark.parametrize("bad", ["sometimes", "AUTO", None])
def test_a_bad_when_names_the_value_and_the_choices(bad: object) -> None:
    with pytest.raises(
        mq.QuantizeValueError, match=rf"when={bad!r} must be one of \['always', 'auto'\]"
    ):
        mq.CompressionConfig(when=bad)  # type: ignore[arg-type]
