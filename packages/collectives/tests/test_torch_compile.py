"""torch.compile around and inside DDP and FSDP2 on the mpx backend, against gloo (issue 31).

torch's C++ calls the process group's Python methods from compiled code (DDP's
bucket rebuild broadcasts); dynamo tried to compile those frames and failed
(``Member '_check_root' is not registered``). Each mode trains on mpx and on
gloo: the losses must be equal, and mpx must cause no graph break gloo has not.
"""

from collections import Counter
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch._dynamo
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.mpi


def _ddp(group: dist.ProcessGroup, module: nn.Module) -> nn.Module:
    return nn.parallel.DistributedDataParallel(module, process_group=group)


def _fsdp(group: dist.ProcessGroup, module: nn.Sequential) -> nn.Module:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in module:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def _compiled(module: nn.Module) -> nn.Module:
    compiled: Any = torch.compile(module)  # an OptimizedModule (typed as a callable)
    return cast(nn.Module, compiled)


MODES: dict[str, Callable[[dist.ProcessGroup, nn.Sequential], nn.Module]] = {
    "compile(DDP(m))": lambda g, m: _compiled(_ddp(g, m)),
    "DDP(compile(m))": lambda g, m: _ddp(g, _compiled(m)),
    "compiled autograd": lambda g, m: _compiled(_ddp(g, m)),
    "compile(fully_shard(m))": lambda g, m: _compiled(_fsdp(g, m)),
}


def _train(group: dist.ProcessGroup, mode: str) -> tuple[list[float], Counter[str]]:
    """Losses of 3 steps, and the graph breaks dynamo met (by reason)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    module = nn.Sequential(
        nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)
    )
    model = MODES[mode](group, module)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(3 + dist.get_rank())
    losses = []
    with torch._dynamo.config.patch(compiled_autograd=mode == "compiled autograd"):
        for _ in range(3):
            x = torch.randn(6, 12, generator=data)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    breaks = Counter(dict(torch._dynamo.utils.counters["graph_break"]))
    torch._dynamo.reset()
    return losses, breaks


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_compiled_training_equals_gloo_with_no_more_graph_breaks(
    groups: dict[str, dist.ProcessGroup], mode: str
) -> None:
    on_gloo, gloo_breaks = _train(groups["gloo"], mode)
    on_mpx, mpx_breaks = _train(groups["mpx"], mode)
    # 3 ranks sum in another order than gloo: equal to rounding.
    torch.testing.assert_close(on_mpx, on_gloo, rtol=1e-6, atol=1e-7)
    assert sum(mpx_breaks.values()) <= sum(gloo_breaks.values()), (
        f"graph breaks on mpx {dict(mpx_breaks)}, on gloo {dict(gloo_breaks)}"
    )
