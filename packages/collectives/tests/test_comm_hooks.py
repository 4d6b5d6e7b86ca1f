"""Every DDP comm hook of torch trains on mpx to gloo's losses (issue 31).

The hooks and their set-up are ``benchmarks/bench_comm_hooks.py``'s table,
which also times them. Losses are bitwise equal to gloo's at 1 and 2 ranks (a
sum of two is the same in any order); at 3 ranks mpx may add in another order
than gloo, so they agree to rounding.
"""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.mpi


def _bench() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_comm_hooks.py"
    spec = importlib.util.spec_from_file_location("bench_comm_hooks", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCH = _bench()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("hook", list(BENCH.HOOKS))
def test_hook_trains_to_gloos_losses(groups: dict[str, dist.ProcessGroup], hook: str) -> None:
    try:
        on_gloo, _ = BENCH.train(groups["gloo"], hook)
    except Exception:
        # torch's hook fails on gloo too, on CPU and torch 2.13 (bf16 needs NCCL;
        # batched PowerSGD orthogonalizes 2-D matrices it asserts are 3-D; the
        # per-tensor quantization hook indexes gloo's flat all_gather value as
        # nested): mpx behaves as gloo, it fails too.
        with pytest.raises(Exception):  # noqa: B017, PT011  (whatever torch's hook raises)
            BENCH.train(groups["mpx"], hook)
        return
    on_mpx, _ = BENCH.train(groups["mpx"], hook)
    if dist.get_world_size() <= 2:
        assert on_mpx == on_gloo
    else:
        # Gradients summed in fp16 round to ~5e-4: a sum in another order differs by that.
        rtol = 2e-3 if "FP16" in hook.upper() else 1e-5
        torch.testing.assert_close(on_mpx, on_gloo, rtol=rtol, atol=1e-7)
