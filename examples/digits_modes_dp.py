"""The main job's data parallel modes (examples/train_digits.py ``--mode dp`` and ``ddp``).

Each returns a function that trains one epoch and evaluates: rank r takes every
P-th sample of each global batch, the gradients are averaged across the ranks.

* :func:`data_parallel`: mpx.dataparallel.DistributedOptimizer, gradients
  quantized to --bits by mpx.quantize (0: full precision).
* :func:`torch_ddp`: torch DistributedDataParallel on mpx's "mpx" backend.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from mpx.collectives import Communicator, allreduce

if TYPE_CHECKING:  # mypy names this folder's modules examples.<name> (explicit_package_bases)
    from examples import digits_data
else:  # run as scripts: this folder is on sys.path
    import digits_data

__all__ = ["data_parallel", "torch_ddp"]


def data_parallel(
    args: argparse.Namespace, data: digits_data.Data, comm: Communicator
) -> Callable[..., Any]:
    import mpx.dataparallel as dp

    torch.manual_seed(args.seed)
    model = dp.synchronize(digits_data.mlp())
    compression = None
    if args.bits:
        from mpx.quantize import CompressionConfig

        # minimal_size 0: with this small model every weight matrix is compressed.
        compression = CompressionConfig(bits=args.bits, bucket_size=512, minimal_size=0)
    inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    opt = dp.DistributedOptimizer(inner, model, compression=compression)
    digits_data.RESUMABLE.append(digits_data.Resumable(model, opt, sharded=False))
    return _replicated_epoch(args, data, comm, model, model, opt)


def _replicated_epoch(
    args: argparse.Namespace,
    data: digits_data.Data,
    comm: Communicator,
    model: nn.Module,
    net: nn.Module,
    opt: torch.optim.Optimizer,
) -> Callable[..., Any]:
    """One epoch of data parallel training: rank r takes every P-th sample of each batch.

    ``model`` is what runs forward (DDP's wrapper, or the network itself), ``net``
    the network (for train/eval and the accuracy).
    """
    loss_fn = nn.CrossEntropyLoss()

    def epoch(index: int) -> tuple[float, float]:
        net.train()
        total = torch.zeros(2, dtype=torch.float64)
        for batch in digits_data.batches(data, index, args.batch_size):
            mine = batch[comm.rank :: comm.size]
            opt.zero_grad()
            loss = loss_fn(model(data.x_train[mine]), data.y_train[mine])
            loss.backward()
            opt.step()
            total += torch.tensor([loss.item() * len(mine), len(mine)], dtype=torch.float64)
        allreduce(total, comm=comm)
        net.eval()
        return float(total[0] / total[1]), digits_data.accuracy_of(net, data)

    return epoch


def torch_ddp(
    args: argparse.Namespace, data: digits_data.Data, comm: Communicator
) -> Callable[..., Any]:
    from mpx.collectives import init_process_group

    init_process_group()
    torch.manual_seed(args.seed)
    net = digits_data.mlp()
    model = nn.parallel.DistributedDataParallel(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    digits_data.RESUMABLE.append(digits_data.Resumable(net, opt, sharded=False))
    return _replicated_epoch(args, data, comm, model, net, opt)
