"""The ``"cgx"`` torch.distributed backend: mpx's, with CGX's quantized allreduce.

CGX users write ``dist.init_process_group("cgx")`` and configure compression
with the ``CGX_*`` variables (or ``MPX_QUANTIZE_*``: :class:`CompressionConfig`).
The group is the ``mpx`` group of mpx-collectives, except that an
``all_reduce`` (SUM or AVG) of one floating tensor goes through
:func:`mpx.quantize.allreduce` — so DDP's gradient buckets travel at
``bits`` per value — while every other operation, dtype and op is exact::

    CGX_COMPRESSION_QUANTIZATION_BITS=4 mpxrun -n 2 -- python train.py   # train.py: "cgx"

``import torch`` registers ``"cgx"`` (entry point ``torch.backends``,
``mpx._quantize_autoload``); :func:`register_torch_backend` does it by hand.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mpx.collectives import Communicator
from mpx.collectives.building_blocks import MPXProcessGroup, MPXWork
from mpx.quantize.allreduce import allreduce
from mpx.quantize.config import CompressionConfig

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "register_torch_backend"]

BACKEND_NAME = "cgx"


class CGXProcessGroup(MPXProcessGroup):
    """The ``"cgx"`` group: floating all_reduce quantized per the CGX configuration.

    Attributes:
        config: the compression settings, read from the environment when the
            group is made (``CompressionConfig.from_env()``).
    """

    def __init__(self, comm: Communicator, timeout: timedelta | None = None) -> None:
        super().__init__(comm, timeout)
        self.config = CompressionConfig.from_env()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> MPXWork:  # type: ignore[override]
        opts = op if op is not None else opts
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        name = self.reduce_op_name(opts, "allreduce")
        t = listed[0]
        if (
            len(listed) == 1
            and name in ("sum", "avg")
            and t.dtype.is_floating_point
            and not t.is_sparse
        ):
            # Quantized when config.compresses(t.numel()); exact below that or at 32 bits.
            allreduce(t, self.comm, op=name, config=self.config)
            return MPXWork([], listed)
        return super().allreduce(listed, opts)


def register_torch_backend() -> None:
    """Registers ``"cgx"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, CGXProcessGroup.create, extended_api=True, devices=["cpu", "cuda"]
        )
