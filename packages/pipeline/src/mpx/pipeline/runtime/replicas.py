"""A stage's gradients averaged over its replicas (2-D), in full precision or quantized.

``Pipeline(data_parallel_comm=...)`` trains pipeline x data parallel: the
pipelines are the rows, the replicas of a stage (``data_parallel_comm``) its
columns::

    replica 0:  stage 0 (rank 0)  -->  stage 1 (rank 1)
                      | avg                  | avg        data_parallel_comm
    replica 1:  stage 0 (rank 2)  -->  stage 1 (rank 3)

Once per optimizer step, after the last micro-batch's backward (``async``:
before each of its steps), each stage averages its gradients over its
replicas: ``compression=None`` with ``mpx.collectives.allreduce`` (exact),
``compression=`` an ``mpx.quantize.CompressionConfig`` (or its bits alone,
``compression=4``) with ``mpx.quantize.allreduce_tensors``, so what
mpx.quantize applies applies here: ``bits`` (1-8; 32 is no compression, the
exact path bit for bit), ``bucket_size``, stochastic or nearest rounding,
error feedback, and layer filtering: 1-D tensors (biases, norms), tensors
below the minimum size, float64 ones and layers whose name holds an
``exclude`` part (or one given to ``mpx.quantize.exclude_layer``) travel in
full precision. A parameter is named as in the whole model (``"3.weight"``
for the weight of layer 3: ``model.named_parameters()``'s names). Every
replica ends with the same bits, so the replicas' weights stay equal.

Per element the quantized average is within the compressed allreduce's bound
of the exact one (:mod:`mpx.quantize.allreduce`): the senders' half units
(divided by the replicas) plus the owner's half unit, with nearest rounding;
whole units with stochastic rounding (the default, unbiased).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, allreduce
from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = ["ReplicaGradients", "compression_config", "model_names"]


def _quantize() -> Any:
    """``mpx.quantize``, or an ImportError that says what to install."""
    try:
        return importlib.import_module("mpx.quantize")
    except ImportError as error:
        raise ImportError(
            "Pipeline(compression=...) needs mpx-quantize: pip install 'mpx-pipeline[quantize]'"
        ) from error


def compression_config(compression: Any, replicas: Communicator | None) -> Any | None:
    """The ``mpx.quantize.CompressionConfig`` that ``compression=`` stands for; None for none.

    Raises:
        PipelineValueError: bits that are not 1-8 or 32, or compression
            without ``data_parallel_comm`` (there is nothing to reduce).
        PipelineTypeError: neither None, an int nor a ``CompressionConfig``.
    """
    if compression is None:
        return None
    quantize = _quantize()
    if isinstance(compression, bool) or not isinstance(
        compression, int | quantize.CompressionConfig
    ):
        raise PipelineTypeError(
            f"compression={compression!r} ({type(compression).__name__}) is not an "
            "mpx.quantize.CompressionConfig, its bits (an int) or None; pass e.g. "
            "compression=mpx.quantize.CompressionConfig(bits=4, bucket_size=512)"
        )
    if replicas is None:
        raise PipelineValueError(
            f"compression={compression!r} quantizes the average of the replicas' gradients "
            "over data_parallel_comm, and none was given; pass data_parallel_comm= (the "
            "replicas of this stage) or leave compression=None"
        )
    if isinstance(compression, int):
        try:
            return quantize.CompressionConfig(bits=compression)
        except quantize.QuantizeValueError:
            raise PipelineValueError(
                f"compression={compression} bits: pass 1 to 8 bits per value, or 32 for no "
                "compression (mpx.quantize's range)"
            ) from None
    return compression


def model_names(
    layers: dict[int, nn.Module], params: list[tuple[str, nn.Parameter]]
) -> list[tuple[str, nn.Parameter]]:
    """``params`` renamed as in the whole model: ``"<layer index>.<name in the layer>"``."""
    names = {id(p): f"{i}.{n}" for i, layer in layers.items() for n, p in layer.named_parameters()}
    return [(names.get(id(p), name), p) for name, p in params]


class ReplicaGradients:
    """Averages a stage's gradients and losses over ``comm`` (see the module's doc).

    Args:
        comm: the replicas of this stage; None or one rank: nothing to do.
        compression: None, or an ``mpx.quantize.CompressionConfig``
            (:func:`compression_config`).
        named: this stage's parameters by their names in the whole model, in
            an order every replica shares.
    """

    def __init__(
        self,
        comm: Communicator | None,
        compression: Any | None,
        named: list[tuple[str, nn.Parameter]],
    ) -> None:
        self.comm = comm if comm is not None and comm.size > 1 else None
        # bits=32 compresses nothing: the exact path, bit for bit (the fused buffers of
        # allreduce_tensors may sum in another order at 3 replicas and more).
        self.config = compression if compression is not None and compression.enabled else None
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.state: Any = None
        if self.comm is not None and self.config is not None:
            # The stochastic rounding's generator, error feedback's residuals, byte counts.
            self.state = _quantize().QuantizeState(self.config, self.comm)

    def average(self) -> None:
        """Every parameter's ``.grad`` becomes the replicas' mean (zeros where None)."""
        if self.comm is None:
            return
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in self.params if p.grad is not None]
        if self.config is None:
            for grad in grads:
                allreduce(grad, "avg", comm=self.comm)
            return
        _quantize().allreduce_tensors(
            grads, self.comm, self.config, "avg", names=self.names, state=self.state
        )

    def average_loss(self, loss: float) -> float:
        """``loss`` averaged over the replicas (exact: one float64)."""
        if self.comm is None:
            return loss
        value = torch.tensor([loss], dtype=torch.float64)
        allreduce(value, "avg", comm=self.comm)
        return float(value)
