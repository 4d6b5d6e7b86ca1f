"""synchronize leaves every rank bit-identical to root: modules, optimizers, trees."""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

import mpx.dataparallel as dp
from mpx.dataparallel import fluxmpi
from mpx.dataparallel.errors import DataParallelError

pytestmark = pytest.mark.mpi


def assert_identical_everywhere(t: torch.Tensor) -> None:
    """``t`` is bit-identical on every rank (compared through mpi4py, not mpx)."""
    mine = t.detach().cpu().reshape(-1).view(torch.uint8)
    for r, other in enumerate(MPI.COMM_WORLD.allgather(mine.clone())):
        assert torch.equal(other, mine), f"rank {MPI.COMM_WORLD.Get_rank()} differs from rank {r}"


def _net() -> nn.Module:
    # Seeded by rank: every rank starts different.
    torch.manual_seed(100 + dp.rank())
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 36, 3)
    )
    net.train()
    net(torch.randn(5, 1, 8, 8))  # BatchNorm running stats and counter move
    return net


@pytest.mark.parametrize("root", [0, -1])
def test_module_parameters_and_buffers(root: int) -> None:
    root = root % dp.world_size()
    net = _net()
    params_before = [p for p in net.parameters()]
    expected = {k: v.clone() for k, v in net.state_dict().items()}
    same = dp.synchronize(net, root=root)
    assert same is net
    assert all(a is b for a, b in zip(params_before, net.parameters(), strict=True))
    for name, value in net.state_dict().items():
        assert_identical_everywhere(value)  # includes running_mean/var, num_batches_tracked
        if dp.rank() == root:
            assert torch.equal(value, expected[name]), name


def test_optimizer_state_adam() -> None:
    net = dp.synchronize(_net())
    opt = torch.optim.Adam(net.parameters(), lr=1e-2 * (1 + dp.rank()))
    # Different number of steps per rank: root may have state others lack.
    for _ in range(1 + dp.rank()):
        net(torch.randn(4, 1, 8, 8)).sum().backward()
        opt.step()
    dp.synchronize(opt)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2)
    for p in net.parameters():
        state = opt.state[p]
        assert set(state) >= {"step", "exp_avg", "exp_avg_sq"}
        for value in state.values():
            assert_identical_everywhere(value)


def test_tensors_and_nested_containers() -> None:
    r = dp.rank()
    tensor = torch.full((3, 2), float(r))
    half = torch.arange(5, dtype=torch.float16) + r
    flags = torch.tensor([True, r == 0, False])
    tree: dict[str, Any] = {
        "a": [tensor, {"b": half}],
        "c": (torch.tensor(r, dtype=torch.int64), r, f"text-{r}"),
        "d": collections.OrderedDict(e=flags),
    }
    out = dp.synchronize(tree)
    assert out is tree
    assert out["a"][0] is tensor  # same shape and dtype: in place
    assert torch.equal(tensor, torch.zeros(3, 2))
    assert torch.equal(half, torch.arange(5, dtype=torch.float16))
    assert out["c"][1] == 0
    assert out["c"][2] == "text-0"
    assert int(out["c"][0]) == 0
    assert torch.equal(out["d"]["e"], torch.tensor([True, True, False]))
    assert_identical_everywhere(flags)


def test_state_dict_and_missing_entries_are_built() -> None:
    state = {"w": torch.randn(4)} if dp.rank() == 0 else {}
    out = dp.synchronize(state)
    assert set(out) == {"w"}
    assert_identical_everywhere(out["w"])


def test_single_tensor_in_place() -> None:
    t = torch.randn(7, 3, dtype=torch.float64).t()  # not contiguous
    assert dp.synchronize(t) is t
    assert_identical_everywhere(t)


def test_mismatched_module_raises_on_every_rank() -> None:
    net = nn.Linear(3 + (dp.rank() % 2), 2)
    if dp.world_size() == 1:
        assert dp.synchronize(net) is net
        pytest.skip("one rank: no rank can hold a module that differs from root's")
    with pytest.raises(DataParallelError, match="differs from root 0"):
        dp.synchronize(net)


def test_fluxmpi_root_rank_spelling() -> None:
    """FluxMPI's ``synchronize!(x; root_rank=r)``, spelled in Python, synchronizes from r."""
    last = dp.world_size() - 1
    for sync in (dp.synchronize, fluxmpi.synchronize):
        t = torch.full((3,), float(dp.rank()))
        assert sync(t, root_rank=last) is t
        assert torch.equal(t, torch.full((3,), float(last)))
        tree = sync({"w": torch.full((2,), float(dp.rank()))}, root=last, root_rank=last)
        assert torch.equal(tree["w"], torch.full((2,), float(last)))


def test_root_and_root_rank_that_differ_raise() -> None:
    with pytest.raises(DataParallelError, match=r"root=0 and root_rank=1 name different ranks"):
        dp.synchronize(torch.zeros(1), root=0, root_rank=1)
    with pytest.raises(ValueError, match="root must be a rank"):
        dp.synchronize(torch.zeros(1), root_rank=dp.world_size())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="root must be a rank"):
        dp.synchronize(torch.zeros(1), root=dp.world_size())
    with pytest.raises(ValueError, match="bucket_mb"):
        dp.synchronize(torch.zeros(1), bucket_mb=0)
    with pytest.raises(TypeError, match="nested inside a container"):
        dp.synchronize({"m": nn.Linear(1, 1)})


def test_mismatched_optimizer_raises_on_every_rank() -> None:
    count = 1 if dp.rank() == 0 else 2
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2)) for _ in range(count)], lr=0.1)
    if dp.world_size() == 1:
        assert dp.synchronize(opt) is opt
        pytest.skip("one rank: no rank can hold an optimizer that differs from root's")
    with pytest.raises(
        DataParallelError, match=r"could not load root's optimizer state on ranks? 1\b"
    ):
        dp.synchronize(opt)
