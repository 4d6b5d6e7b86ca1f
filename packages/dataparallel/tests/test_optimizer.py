"""DistributedOptimizer: P ranks on P shards == one process on the whole batch.

The reference is computed on every rank by plain torch, single-process, on
the concatenated batch (float64); the distributed run must match it to 1e-10
under any number of ranks.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpx.dataparallel as dp
from mpx.dataparallel.errors import DataParallelError

pytestmark = pytest.mark.mpi

BATCH = 6  # rows per rank
OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
}


def _model(dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def _batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH * size, 5, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH * size, 3, generator=g, dtype=torch.float64)
    return x, y


def _shard(t: torch.Tensor) -> torch.Tensor:
    return t[dp.rank() * BATCH : (dp.rank() + 1) * BATCH]


def _assert_same_everywhere(model: nn.Module) -> None:
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    for other in MPI.COMM_WORLD.allgather(mine):
        assert torch.equal(other, mine)


@pytest.mark.parametrize("overlap", [True, False, "auto"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_steps_equal_single_process_on_concatenated_batch(name: str, overlap: bool | str) -> None:
    size = dp.world_size()
    reference = _model()
    ref_opt = OPTIMIZERS[name](list(reference.parameters()))
    model = _model()
    opt = dp.DistributedOptimizer(
        OPTIMIZERS[name](list(model.parameters())), model, overlap=overlap, bucket_mb=0.001
    )
    assert len(opt._buckets) > 1  # several buckets really in flight
    for step in range(3):
        x, y = _batch(step, size)
        ref_opt.zero_grad()
        nn.functional.mse_loss(reference(x), y).backward()
        ref_opt.step()
        opt.zero_grad()
        nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    _assert_same_everywhere(model)


@pytest.mark.parametrize("overlap", [True, False])
def test_buckets_start_while_backward_still_runs(overlap: bool) -> None:
    model = _model()
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=1e-6, overlap=overlap
    )
    assert len(opt._buckets) == 4  # one per parameter, last layer's first
    started_midway: list[int] = []
    hidden = model[0](torch.ones(2, 5, dtype=torch.float64))
    # Fires when backward reaches the first layer: the last layer is done by then.
    hidden.register_hook(lambda g: started_midway.append(opt._next))
    model[2](model[1](hidden)).sum().backward()
    assert started_midway == ([2] if overlap else [0])
    assert opt._next == (4 if overlap else 0)
    opt.step()


def test_gradient_accumulation_with_no_sync() -> None:
    size = dp.world_size()
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    model = _model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    for step in range(2):
        micro = [_batch(10 * step + k, size) for k in range(3)]
        ref_opt.zero_grad()
        for x, y in micro:
            (nn.functional.mse_loss(reference(x), y) / 3).backward()
        ref_opt.step()
        opt.zero_grad()
        for k, (x, y) in enumerate(micro):
            loss = nn.functional.mse_loss(model(_shard(x)), _shard(y)) / 3
            if k < 2:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


class _Branchy(nn.Module):
    """Rank r uses branch ``r % 2`` only; ``never`` is used by no rank."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.trunk = nn.Linear(4, 4).double()
        self.branch = nn.ModuleList([nn.Linear(4, 2).double(), nn.Linear(4, 2).double()])
        self.never = nn.Linear(4, 2).double()

    def forward(self, x: torch.Tensor, which: int) -> torch.Tensor:
        out: torch.Tensor = self.branch[which](self.trunk(x))
        return out


def test_unused_parameters_do_not_deadlock_and_match_ddp_semantics() -> None:
    size = dp.world_size()
    model = _Branchy()
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1.0), model, bucket_mb=1e-5
    )
    x = torch.ones(3, 4, dtype=torch.float64) * (1 + dp.rank())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(x, dp.rank() % 2).sum().backward()
    opt.step()
    # Reference: each rank's gradient (zeros where unused), averaged.
    expected: dict[str, torch.Tensor] = {}
    for r in range(size):
        ref = _Branchy()
        ref(torch.ones(3, 4, dtype=torch.float64) * (1 + r), r % 2).sum().backward()
        for n, p in ref.named_parameters():
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            expected[n] = expected.get(n, torch.zeros_like(p)) + g / size
    for n, p in model.named_parameters():
        if n.startswith("never"):
            assert p.grad is None  # no rank used it: untouched, as in one process
            assert torch.equal(p, before[n])
        elif n.startswith("branch.1") and size == 1:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-12)
            torch.testing.assert_close(p.detach(), before[n] - expected[n], rtol=0, atol=1e-12)
    _assert_same_everywhere(model)
    # Next step every rank uses branch 0: branch 1 (used before) is unused now and,
    # after zero_grad(set_to_none=True), must come back as None, as in one process.
    opt.zero_grad()
    model(x, 0).sum().backward()
    opt.step()
    assert model.branch[1].weight.grad is None
    assert model.never.weight.grad is None
    assert model.branch[0].weight.grad is not None
    assert model.trunk.weight.grad is not None
    _assert_same_everywhere(model)


def test_mixed_dtypes_get_one_bucket_each() -> None:
    torch.manual_seed(2)
    model = nn.ModuleDict({"a": nn.Linear(3, 3).double(), "b": nn.Linear(3, 3).float()})
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model)
    assert {b.dtype for b in opt._buckets} == {torch.float32, torch.float64}
    x = torch.full((2, 3), float(dp.rank() + 1))
    (model["a"](x.double()).sum() + model["b"](x).sum()).backward()
    mean_scale = sum(r + 1 for r in range(dp.world_size())) / dp.world_size()
    opt.step()
    assert model["a"].weight.grad is not None
    assert model["b"].weight.grad is not None
    torch.testing.assert_close(
        model["a"].weight.grad, torch.full((3, 3), 2 * mean_scale, dtype=torch.float64)
    )
    torch.testing.assert_close(model["b"].weight.grad, torch.full((3, 3), 2 * mean_scale))


def test_sum_instead_of_average_and_manual_gradients() -> None:
    p = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    opt = dp.DistributedOptimizer(torch.optim.SGD([p], lr=1.0), average=False)
    p.grad = torch.full((4,), float(dp.rank() + 1), dtype=torch.float64)  # no hook fires
    opt.step()
    total = sum(r + 1 for r in range(dp.world_size()))
    assert torch.equal(p.detach(), torch.full((4,), -float(total), dtype=torch.float64))


def test_lbfgs_closure() -> None:
    size = dp.world_size()
    x, y = _batch(0, size)
    reference, model = _model(), _model()
    # As an Optimizer: LBFGS's own step() is unannotated, the base class's is typed.
    ref_opt: torch.optim.Optimizer = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=4)
    opt = dp.DistributedOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), model)

    def ref_closure() -> float:
        ref_opt.zero_grad()
        loss = nn.functional.mse_loss(reference(x), y)
        loss.backward()
        return float(loss.detach())

    def closure() -> float:
        opt.optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(_shard(x)), _shard(y))
        loss.backward()
        return float(loss.detach())

    ref_opt.step(ref_closure)
    opt.step(closure)
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-8)


def test_lr_scheduler_accepts_it() -> None:
    model = _model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.ones(1, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    sched.step()
    assert opt.optimizer.param_groups[0]["lr"] == pytest.approx(0.5)


def test_misuse_errors() -> None:
    model = _model()
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x = torch.ones(2, 5, dtype=torch.float64)
    model(x).sum().backward()
    with pytest.raises(
        DataParallelError,
        # A Pipeline's stage runs a backward a micro-batch: the error points at its own way.
        match=r"arrived twice.* give it data_parallel_comm= and compression= instead",
    ):
        model(x).sum().backward()
    opt.zero_grad()  # finishes what the first backward started, on every rank
    with opt.no_sync(), pytest.raises(DataParallelError, match="inside no_sync"):
        opt.step()


def test_bad_arguments() -> None:
    model = _model()
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        dp.DistributedOptimizer(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bucket_mb must be positive, got 0"):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), bucket_mb=0)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameter requires grad"):
        dp.DistributedOptimizer(torch.optim.SGD(frozen.parameters(), lr=1), frozen)
    with pytest.raises(ValueError, match="overlap must be True, False or 'auto', got 'yes'"):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1), overlap="yes")


def test_zero_grad_drops_bucket_aliases_and_backward_restores_them() -> None:
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = dp.DistributedOptimizer(inner, model, bucket_mb=1e-3)
    x, y = _batch(0, dp.world_size())
    for _ in range(2):
        opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        for bucket in opt._buckets:
            for p, view in zip(bucket.params, bucket.views, strict=True):
                assert p.grad is view  # reduced in place, no copy out
        opt.step()
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        assert p.grad is not None
        assert not bool(p.grad.any())


def test_overlap_auto_uses_idle_hardware_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    from types import SimpleNamespace as NS

    from mpx.dataparallel.synchronous.optimizer import overlap_pays

    cpu, gpu = [NS(device=torch.device("cpu"))], [NS(device=torch.device("cuda", 0))]
    one_node = NS(size=2, single_node=True, node_size=2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert not overlap_pays(cpu, one_node)  # type: ignore[arg-type]  # 2 ranks x 1 thread, 2 cores
    assert overlap_pays(gpu, one_node)  # type: ignore[arg-type]  # the device computes
    assert overlap_pays(cpu, NS(size=4, single_node=False, node_size=2))  # type: ignore[arg-type]
    assert not overlap_pays(cpu, NS(size=1, single_node=True, node_size=1))  # type: ignore[arg-type]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert overlap_pays(cpu, one_node)  # type: ignore[arg-type]  # idle cores left
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    assert not overlap_pays(cpu, one_node)  # type: ignore[arg-type]


def test_compressed_buckets_through_mpx_quantize() -> None:
    # Activates once mpx-quantize provides allreduce (the only skip in this suite).
    quantize = pytest.importorskip("mpx.quantize")
    if not hasattr(quantize, "allreduce"):
        pytest.skip("mpx.quantize.allreduce is not there yet")
    config = quantize.CompressionConfig(bits=4, bucket_size=64)
    size = dp.world_size()
    reference, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, compression=config
    )
    x, y = (t.float() for t in _batch(0, size))
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    opt.step()
    _assert_same_everywhere(model)
    # 4-bit gradients: off by at most lr * unit / 2 per value (unit = bucket range / 15).
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0.02)
    if size > 1:  # the buckets really went through the quantized allreduce
        got_all = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        want_all = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
        assert not torch.equal(got_all, want_all)
    assert importlib.import_module("mpx.quantize") is quantize


def test_compression_filters_layers_as_cgx_does() -> None:
    """exclude= and 1-D parameters stay in full precision (whole buckets were quantized before)."""
    quantize = pytest.importorskip("mpx.quantize")
    x, y = (t.float() for t in _batch(0, dp.world_size()))
    configs = {
        "plain": None,
        "2-bit": quantize.CompressionConfig(bits=2, bucket_size=64, exclude=("0.weight",)),
    }
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for label, config in configs.items():
        model = _model(torch.float32)
        opt = dp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, compression=config
        )
        nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
        opt.step()
        grads[label] = {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None
        }
        opt.remove_hooks()
    error = {n: float((grads["2-bit"][n] - g).abs().max()) for n, g in grads["plain"].items()}
    for name in ("0.weight", "0.bias", "2.bias"):  # excluded by name, and 1-D
        assert error[name] < 1e-6, (name, error)
    if dp.world_size() > 1:  # one rank: nothing is communicated, nothing quantized
        assert error["2.weight"] > 1e-4, error  # 2 bits: really compressed


@pytest.mark.parametrize("compressed_wins", [False, True])
def test_when_auto_steps_aside_or_keeps_compressing(
    monkeypatch: pytest.MonkeyPatch, compressed_wins: bool
) -> None:
    """compression=CompressionConfig(when="auto"): where the plain allreduce was measured
    faster for every bucket, the optimizer reduces as without compression from step 2
    (non-blocking); where compression won, it keeps it. MARGIN forces the outcome."""
    quantize = pytest.importorskip("mpx.quantize")
    from mpx.quantize import compression_choice

    monkeypatch.setattr(compression_choice, "MARGIN", -1e12 if compressed_wins else 1.0)
    config = quantize.CompressionConfig(bits=4, bucket_size=64, when="auto")
    x, y = (t.float() for t in _batch(0, dp.world_size()))
    trained = {}
    runs = (("auto", config), ("fp32", None), ("4-bit", config.with_(when="always")))
    stepped_aside = False
    for label, compression in runs:
        model = _model(torch.float32)
        opt = dp.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, compression=compression
        )
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
            opt.step()
        trained[label] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        if label == "auto":
            stepped_aside = opt.compression is None
        opt.remove_hooks()
    if dp.world_size() == 1:  # nothing communicated: nothing measured, nothing decided
        assert not stepped_aside
        return
    assert stepped_aside is not compressed_wins
    if compressed_wins:
        assert torch.equal(trained["auto"], trained["4-bit"])  # the same bits as always
        assert not torch.equal(trained["auto"], trained["fp32"])
    else:  # the plain allreduce: fp32's values (per-buffer sums may round apart by an ulp)
        torch.testing.assert_close(trained["auto"], trained["fp32"], rtol=1e-6, atol=1e-7)


def test_models_with_different_layouts_raise_at_construction() -> None:
    """Parameter shapes or counts that differ across ranks trained on garbage, silently."""
    from mpx.collectives import MismatchError

    width = 16 if dp.rank() == 0 else 17
    model = nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, 3))
    if dp.world_size() == 1:
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
        return
    with pytest.raises(
        MismatchError,
        match=r"DistributedOptimizer: ranks disagree on parameter 0: rank 0 has '0.weight' "
        r"float32\[16, 5\], rank 1 '0.weight' float32\[17, 5\]",
    ):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    deeper = nn.Sequential(*[nn.Linear(4, 4) for _ in range(1 + (dp.rank() > 0))])
    with pytest.raises(MismatchError, match="number of parameters: rank 0 has 2, rank 1 4"):
        dp.DistributedOptimizer(torch.optim.SGD(deeper.parameters(), lr=0.1), deeper)


def test_models_initialised_differently_raise_at_the_first_step() -> None:
    """Never synchronised, the ranks diverged silently; synchronize() is the fix it names."""
    torch.manual_seed(dp.rank())  # a different initialisation per rank
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(torch.float64)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = _batch(0, dp.world_size())
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    if dp.world_size() == 1:
        opt.step()
        return
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        dp.DataParallelMismatchError,
        match=r"parameter '0.weight' has different values on rank 0 and rank\(s\) \[1",
    ):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    opt.remove_hooks()
    model = dp.synchronize(model)  # the fix the error names
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    opt.zero_grad()
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    opt.step()
    _assert_same_everywhere(model)


def test_an_mpi4py_communicator_is_accepted_as_comm() -> None:
    """torchbraid's and FluxMPI-over-mpi4py's convention, comm=MPI.COMM_WORLD."""
    from mpx.collectives import world

    model = _model()
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, comm=MPI.COMM_WORLD
    )
    assert opt.comm is world()
    x, y = _batch(0, dp.world_size())
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    opt.step()
    _assert_same_everywhere(model)
    dp.synchronize(model, comm=MPI.COMM_WORLD)


@pytest.mark.parametrize("impl", ["mpi", "ring", "shm"])
def test_impl_names_the_implementation_that_reduces_the_buckets(impl: str) -> None:
    size = dp.world_size()
    reference, model = _model(), _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, bucket_mb=0.001, impl=impl
    )
    x, y = _batch(0, size)
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    opt.step()
    for got, want in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


def test_impl_cgx_quantizes_whole_buckets(monkeypatch: pytest.MonkeyPatch) -> None:
    """mpx-quantize's registered implementation, selected by name (no compression config)."""
    pytest.importorskip("mpx.quantize")
    from mpx.launch.settings import reload as reload_settings

    monkeypatch.setenv("MPX_QUANTIZE_BITS", "4")
    monkeypatch.setenv("MPX_QUANTIZE_MINIMAL_SIZE", "16")
    reload_settings()
    size = dp.world_size()
    reference, model = _model(torch.float32), _model(torch.float32)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, impl="cgx")
    x, y = (t.float() for t in _batch(0, size))
    nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    opt.step()
    _assert_same_everywhere(model)
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    torch.testing.assert_close(got, want, rtol=0, atol=0.02)
    if size > 1:  # quantized: not the exact step
        assert not torch.equal(got, want)
    monkeypatch.delenv("MPX_QUANTIZE_BITS")
    monkeypatch.delenv("MPX_QUANTIZE_MINIMAL_SIZE")
    reload_settings()


def test_impl_errors_name_the_value() -> None:
    params = list(_model().parameters())
    with pytest.raises(ValueError, match=r"impl='bogus' is not an implementation of allreduce"):
        dp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), impl="bogus")
    with pytest.raises(ValueError, match="pass compression= or impl=, not both"):
        dp.DistributedOptimizer(torch.optim.SGD(params, lr=0.1), compression=object(), impl="mpi")


def test_impl_that_declines_a_bucket_is_refused_at_construction(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The implementation's registry declarations (dtypes, reduce ops) decide, before backward."""
    from mpx.collectives import Implementation
    from mpx.collectives.core import registry

    narrow = Implementation(
        "narrow",
        "mpx.collectives.impl.mpi",
        frozenset({"allreduce"}),
        frozenset({"cpu"}),
        automatic=False,
        dtypes=frozenset({torch.float32}),
        reduce_ops=frozenset({"sum"}),
    )
    monkeypatch.setitem(registry._registry, "narrow", narrow)
    model = _model(torch.float64)
    with pytest.raises(ValueError, match=r"float64 gradient .*impl='narrow' takes dtypes float32"):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, impl="narrow")
    model = _model(torch.float32)
    with pytest.raises(ValueError, match=r"op='avg'\) cannot be reduced: .*reduces with sum"):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, impl="narrow")
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, average=False, impl="narrow"
    )
    assert opt.impl == "narrow"


def test_close_finishes_the_reduction_detaches_the_hooks_and_use_after_names_close() -> None:
    """close() is collective and idempotent: the buckets in flight are reduced (the averaged
    gradient, as step() would give it), the hooks are gone, the caller's comm stays open."""
    from mpx.collectives import world
    from mpx.dataparallel.errors import DataParallelValueError

    size = dp.world_size()
    model = _model()
    opt = dp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, overlap=True, bucket_mb=0.001
    )
    x, y = _batch(0, size)
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()  # buckets start in flight
    opt.close()
    opt.close()  # a second close() does nothing
    reference = _model()
    nn.functional.mse_loss(reference(x), y).backward()  # the whole batch: the average
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)
    # No hook left: a second backward accumulates locally instead of raising "arrived twice".
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    nn.functional.mse_loss(model(_shard(x)), _shard(y)).backward()
    after = [p.grad for p in model.parameters() if p.grad is not None]
    assert len(after) == len(before) == 4
    assert all(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    for use in (opt.step, opt.zero_grad, opt.no_sync().__enter__):
        with pytest.raises(DataParallelValueError, match=r"after close\(\)"):
            use()
    assert opt.comm is world()
    assert world().mpi != MPI.COMM_NULL
    opt.optimizer.step()  # the wrapped optimizer works alone


def test_close_gives_back_the_shared_buckets_and_keeps_the_gradients() -> None:
    """A large CPU bucket on one node lives in node-shared memory (one MPI window each);
    close() copies the gradients that alias it out and gives the memory back, so a
    process may build and close more optimizers than MPI has windows (MPICH: ~2000)."""
    size = dp.world_size()
    torch.manual_seed(0)
    model = nn.Linear(400, 400, dtype=torch.float64)  # 1.3 MB: a shared bucket on 2+ ranks
    reference = nn.Linear(400, 400, dtype=torch.float64)
    reference.load_state_dict(model.state_dict())
    opt = dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2 * size, 400, dtype=torch.float64, generator=g)
    mine = x[2 * dp.rank() : 2 * dp.rank() + 2]
    (model(mine) ** 2).mean().backward()
    opt.step()  # the gradients now alias the buckets
    shared = [b for b in opt._buckets if b.shared]
    assert len(shared) == (1 if size > 1 else 0)  # one rank reduces nothing: no window
    opt.close()
    assert all(b.flat is None and not b.shared for b in shared)
    (reference(x) ** 2).mean().backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None
        assert q.grad is not None
        p.grad.mul_(1.0)  # the memory it reads is its own
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.extended
def test_more_optimizers_than_mpi_has_windows_build_and_close() -> None:
    """Without close() giving the shared buckets back, rank 1 crashed after ~2000 (MPICH)."""
    model = nn.Linear(400, 400, dtype=torch.float64)
    for _ in range(2100):
        dp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model).close()
