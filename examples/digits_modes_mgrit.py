"""The main job's layer-parallel mode (examples/train_digits.py ``--mode mgrit``).

:func:`layer_parallel`: mpx.mgrit.LayerParallel, --steps residual layers split
across the ranks, forward and backward solved with MGRIT; each epoch records
the forward solve's residuals (the plot's third panel).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from mpx.collectives import Communicator

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import digits_data
else:  # run as scripts: this folder is on sys.path
    import digits_data

__all__ = ["layer_parallel"]


def layer_parallel(
    args: argparse.Namespace,
    data: digits_data.Data,
    comm: Communicator,
    history: digits_data.History,
) -> Callable[..., Any]:
    from mpx.mgrit import LayerParallel

    torch.manual_seed(args.seed)
    net = LayerParallel(
        nn.Sequential(nn.Linear(64, 64), nn.ReLU()),
        nn.Sequential(nn.Linear(64, 64), nn.Tanh()),
        nn.Linear(64, 10),
        num_steps=args.steps,
        Tf=1.0,
        comm=comm,
        levels=2,
        cfactor=2,
        fwd_iters=2,
        bwd_iters=1,
    )
    opt = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    digits_data.RESUMABLE.append(digits_data.Resumable(net, opt, sharded=True))
    loss_fn = nn.CrossEntropyLoss()

    def epoch(index: int) -> tuple[float, float]:
        net.train()
        losses = []
        for batch in digits_data.batches(data, index, args.batch_size):
            opt.zero_grad()
            loss = loss_fn(net(data.x_train[batch]), data.y_train[batch])
            loss.backward()
            opt.step()
            losses.append(loss.item())
        history.residuals.append(list(net.fwd_stats().get("residuals", [])))
        net.eval()
        return float(np.mean(losses)), digits_data.accuracy_of(net, data)

    return epoch
