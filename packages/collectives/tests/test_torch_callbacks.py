"""Callbacks on the mpx backend's futures that start collectives and wait for them (issue 31).

torch's PowerSGD hook waits, inside a future's callback, for an allreduce it
started there; torch's built-in FP16 hook reads the future's value in C++ as
a tensor list. Both hung or aborted on mpx while the progress thread alone
completed futures and completed them with a Python object.
"""

# No `from __future__ import annotations`: DDP checks a comm hook's annotations at runtime.
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

pytestmark = pytest.mark.mpi


def _until(done: Callable[[], bool]) -> None:
    """Polls ``done()`` (the test's timeout bounds it); never waits on the work itself."""
    while not done():
        time.sleep(1e-3)


def _nested(
    group: dist.ProcessGroup, depth: int, chain_with_then: bool
) -> "torch.futures.Future[float]":
    """A future whose callback allreduces and waits, whose callback does too, ``depth`` deep.

    Level k allreduces ``k + rank`` and adds the sum to what level k - 1 found;
    with ``chain_with_then`` each wait is on a future chained with ``then``.
    """
    rank = dist.get_rank()

    def level(k: int) -> Callable[[torch.futures.Future[Any]], float]:
        def callback(previous: torch.futures.Future[Any]) -> float:
            found = float(previous.value()[0].sum()) if k == 1 else float(previous.value())
            if k > depth:
                return found
            t = torch.full((1,), float(k + rank))
            work = dist.all_reduce(t, group=group, async_op=True)
            assert work is not None
            future = work.get_future()
            if chain_with_then:
                future = future.then(lambda f: f.value()[0] + 0)
            future.wait()  # the nested wait: nothing but this thread can drive it here
            inner: torch.futures.Future[float] = torch.futures.Future()
            inner.set_result(found + float(t.sum()))
            return level(k + 1)(inner)

        return callback

    start = dist.all_reduce(torch.zeros(1), group=group, async_op=True)
    assert start is not None
    chained: torch.futures.Future[float] = start.get_future().then(level(1))
    return chained


@pytest.mark.timeout(60)
@pytest.mark.parametrize("chain_with_then", [False, True], ids=["wait", "then-wait"])
@pytest.mark.parametrize("depth", [1, 3])
def test_a_callback_may_wait_on_another_collective_at_any_depth(
    groups: dict[str, dist.ProcessGroup], depth: int, chain_with_then: bool
) -> None:
    size = dist.get_world_size()
    expected = sum(size * k + size * (size - 1) / 2 for k in range(1, depth + 1))
    # Nobody waits: whoever completes the first future runs the nested waits.
    by_itself = _nested(groups["mpx"], depth, chain_with_then)
    _until(by_itself.done)
    assert by_itself.value() == expected
    # The caller waits: its wait drives the first operation, then the nested ones.
    waited = _nested(groups["mpx"], depth, chain_with_then)
    assert waited.wait() == expected


def _train(
    group: dist.ProcessGroup,
    register: Callable[[nn.parallel.DistributedDataParallel], None],
    bucket_cap_mb: float = 25.0,
) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(24, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4)
    )
    ddp = nn.parallel.DistributedDataParallel(
        model, process_group=group, bucket_cap_mb=bucket_cap_mb
    )
    register(ddp)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(11 + dist.get_rank())
    losses = []
    for _ in range(6):
        x = torch.randn(16, 24, generator=data)
        opt.zero_grad()
        loss = ddp(x).pow(2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(120)
def test_powersgd_trains_to_gloos_losses(groups: dict[str, dist.ProcessGroup]) -> None:
    """PowerSGD (compressed from step 2): its callbacks wait on the allreduces they start.

    One bucket, as torch's own tests: with several, the callbacks of one bucket
    start collectives while backward starts the next bucket's, in an order
    that may differ between ranks (gloo hangs then, as torch's PowerSGD does).
    """

    def power_sgd(
        group: dist.ProcessGroup,
    ) -> Callable[[nn.parallel.DistributedDataParallel], None]:
        def register(ddp: nn.parallel.DistributedDataParallel) -> None:
            state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=2,
                start_powerSGD_iter=2,
                min_compression_rate=0.5,
                random_seed=5,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

        return register

    on_mpx = _train(groups["mpx"], power_sgd(groups["mpx"]))
    on_gloo = _train(groups["gloo"], power_sgd(groups["gloo"]))
    # 3 ranks sum in another order than gloo: equal to rounding, not bitwise.
    torch.testing.assert_close(on_mpx, on_gloo, rtol=1e-5, atol=1e-7)


@pytest.mark.timeout(120)
def test_builtin_fp16_hook_trains_to_gloos_losses(groups: dict[str, dist.ProcessGroup]) -> None:
    """torch's C++ FP16 hook reads the allreduce's future as a c10 tensor list."""

    def fp16(ddp: nn.parallel.DistributedDataParallel) -> None:
        builtin: Any = dist.BuiltinCommHookType  # type: ignore[attr-defined]  # (not in the stubs)
        ddp._register_builtin_comm_hook(builtin.FP16_COMPRESS)  # type: ignore[no-untyped-call]

    on_mpx = _train(groups["mpx"], fp16, bucket_cap_mb=0.002)  # several buckets
    on_gloo = _train(groups["gloo"], fp16, bucket_cap_mb=0.002)
    torch.testing.assert_close(on_mpx, on_gloo, rtol=1e-3, atol=1e-5)


@pytest.mark.timeout(60)
def test_futures_to_cpp_carry_the_work_error(groups: dict[str, dist.ProcessGroup]) -> None:
    """A failed work fails the tensor-list future torch's C++ gets, as the Python one."""
    from mpx.collectives.torch.futures import tensor_list_future

    t = torch.ones(2)
    ok, complete_ok = tensor_list_future([t])
    failed, complete_failed = tensor_list_future([t])
    complete_ok(None)
    complete_failed(ValueError("the bad value"))
    assert torch.equal(ok.wait()[0], t)
    with pytest.raises(RuntimeError, match="ValueError: the bad value"):
        failed.wait()


@pytest.mark.timeout(120)
def test_ddp_without_builtin_hook_gets_no_tensor_list_futures(
    groups: dict[str, dist.ProcessGroup], monkeypatch: pytest.MonkeyPatch
) -> None:
    """DDP's own reduction reads the Python future: no TorchScript task per bucket (issue 31).

    A tensor-list future costs a GIL release and an inter-op hop per bucket
    (DDP on mpx went from 0.70-0.75x to 0.76-0.84x gloo's step time); only a
    group with a C++ reader of lists (a built-in hook) pays it.
    """
    from mpx.collectives.torch import futures as torch_futures

    made: list[int] = []
    original = torch_futures.tensor_list_future

    def counted(tensors: list[torch.Tensor]) -> Any:
        made.append(len(tensors))
        return original(tensors)

    monkeypatch.setattr(torch_futures, "tensor_list_future", counted)
    from mpx.collectives.torch import work as torch_work  # MPXWork's module, which makes them

    monkeypatch.setattr(torch_work, "tensor_list_future", counted)
    group = dist.new_group(backend="mpx")
    try:
        _train(group, lambda ddp: None, bucket_cap_mb=0.002)
        assert made == []
        fp16: Any = dist.BuiltinCommHookType.FP16_COMPRESS  # type: ignore[attr-defined]

        def builtin(ddp: nn.parallel.DistributedDataParallel) -> None:
            ddp._register_builtin_comm_hook(fp16)  # type: ignore[no-untyped-call]

        _train(group, builtin, bucket_cap_mb=0.002)
        assert made  # the built-in hook's group gets them from its registration on
    finally:
        dist.destroy_process_group(group)
