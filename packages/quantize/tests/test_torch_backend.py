"""The "cgx" torch.distributed backend: mpx's group, floating all_reduce quantized."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from mpx.collectives import init_process_group, world


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[str, dist.ProcessGroup]]:
    """The default group on mpx, and a "cgx" and a gloo group over the same ranks."""
    from mpx.launch import init_torch_env

    init_torch_env()
    init_process_group("env://")
    cgx = dist.new_group(backend="cgx")  # registered by import torch (entry point)
    gloo = dist.new_group(backend="gloo")
    yield {"cgx": cgx, "gloo": gloo}
    dist.destroy_process_group()


@pytest.mark.mpi
def test_cgx_quantizes_floating_all_reduce_and_keeps_the_rest_exact(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    size, rank = world().size, world().rank
    assert dist.get_backend(groups["cgx"]) == "cgx"
    data = torch.Generator().manual_seed(rank)
    t = torch.rand(4096, generator=data)
    exact = t.clone()
    dist.all_reduce(exact, group=groups["gloo"])
    dist.all_reduce(t, group=groups["cgx"])  # CompressionConfig's default: 4 bits
    if size == 1:
        assert torch.equal(t, exact)
    else:
        # Rounded twice to one of 16 levels of a bucket's range: each rank's values
        # in [0, 1) (off by < 1/15 each), then the partial sums, in [0, size).
        assert not torch.equal(t, exact)
        assert (t - exact).abs().max().item() <= 2 * size / 15 + 1e-6
    ints = torch.arange(10) * (rank + 1)
    dist.all_reduce(ints, group=groups["cgx"])
    assert ints.tolist() == [i * size * (size + 1) // 2 for i in range(10)]
    top = torch.full((4096,), float(rank))
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=groups["cgx"])
    assert top.eq(size - 1).all()


def test_import_torch_registers_cgx_without_starting_mpi() -> None:
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "print('cgx' in dist.Backend.backend_list, 'mpi4py' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    seen = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    assert seen.stdout.split() == ["True", "False"]
