"""The ``"cgx"`` torch.distributed backend: mpx's, with CGX's quantized allreduce.

CGX users write ``import torch_cgx`` (a module mpx-quantize installs) and
``dist.init_process_group("cgx")``, and configure compression with the
``CGX_*`` variables (or ``MPX_QUANTIZE_*``: :class:`CompressionConfig`). The
group is the ``mpx`` group of mpx-collectives, except that an ``all_reduce``
(SUM or AVG) of one float32, float16 or bfloat16 tensor goes through
:func:`mpx.quantize.allreduce` -- so DDP's gradient buckets travel at ``bits``
per value -- while every other operation, dtype and op is exact::

    CGX_COMPRESSION_QUANTIZATION_BITS=4 mpxrun -n 2 -- python train.py   # train.py: "cgx"

As in CGX:

- with no bits variable set the bits are 32: nothing is quantized (the group
  is then exactly ``mpx``);
- after ``register_model(layers)`` each bucket is split back into its layers
  (:class:`mpx.quantize.buckets.BucketMatcher`, from the layers' sizes and
  DDP's bucket order), and the layers ``exclude_layer`` names, or smaller than
  the minimal size, are reduced exact while the others are quantized.

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
from mpx.quantize.buckets import BucketMatcher, Segments
from mpx.quantize.config import CompressionConfig, registry
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.format import FLOAT_DTYPES
from mpx.quantize.settings import CONFIG

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "register_torch_backend"]

BACKEND_NAME = "cgx"


class CGXProcessGroup(MPXProcessGroup):
    """The ``"cgx"`` group: floating all_reduce quantized per the CGX configuration.

    Attributes:
        config: the compression settings, read from the environment when the
            group is made (``CompressionConfig.from_env()``; 32 bits, i.e. no
            quantization, when no bits variable is set, as CGX).
        layers: maps buckets to the layers of ``register_model`` (layer filtering).
    """

    def __init__(self, comm: Communicator, timeout: timedelta | None = None) -> None:
        super().__init__(comm, timeout)
        config = CompressionConfig.from_env()
        if not CONFIG["bits"].is_set():
            # CGX's default: CGX_COMPRESSION_QUANTIZATION_BITS=32, no quantization.
            config = config.with_(bits=32)
        self.config = config
        self.layers = BucketMatcher()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> MPXWork:  # type: ignore[override]
        opts = op if op is not None else opts
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        name = self.reduce_op_name(opts, "allreduce")
        t = listed[0]
        if not (
            self.config.enabled
            and len(listed) == 1
            and name in ("sum", "avg")
            and t.dtype in FLOAT_DTYPES
            and not t.is_sparse
            and t.numel() >= self.config.min_compressed
        ):
            return super().allreduce(listed, opts)  # exact: mpx's own
        # The work is made by the group (``_work``), as the exact path's: it carries
        # the group's timeout and hands torch's C++ tensor-list futures only where
        # the group has a C++ reader of lists (``cpp_reads_lists``: a built-in comm
        # hook), not a TorchScript task per DDP bucket always.
        if not self.layers.active():  # no layers registered: the tensor as a whole
            self._check_no_exclusion(t.numel())
            allreduce(t, self.comm, op=name, config=self.config)
            return self._work([], listed)
        segments = self.layers.segments(t.numel(), self.config)
        if not any(quantized for _, quantized in segments):
            return super().allreduce(listed, opts)
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        self._reduce_segments(flat, segments, name)
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return self._work([], listed)

    def _check_no_exclusion(self, numel: int) -> None:
        """Raises where layers are to be excluded by name but none are registered.

        A bucket is known by its layers' sizes only after ``register_model``;
        without it an exclusion (``exclude_layer``, ``MPX_QUANTIZE_EXCLUDE``)
        would be skipped in silence and the excluded layers quantized.
        """
        excluded = (*self.config.exclude, *registry.excluded)
        if excluded:
            raise QuantizeValueError(
                f"the cgx group: layers {list(excluded)} are to be excluded by name, but no "
                f"layers are registered, so this tensor of {numel} elements would be "
                "quantized whole; call torch_cgx.register_model([(name, p.numel()) for name, "
                "p in model.named_parameters()]) (or mpx.quantize.register_model(model)) first"
            )

    def _reduce_segments(self, flat: torch.Tensor, segments: Segments, op: str) -> None:
        """Reduces the quantized runs of ``flat`` together, then the exact ones, in place."""
        runs: dict[bool, list[torch.Tensor]] = {True: [], False: []}
        offset = 0
        for length, quantized in segments:
            runs[quantized].append(flat[offset : offset + length])
            offset += length
        # The same two calls in the same order on every rank (same segments).
        for quantized in (True, False):
            views = runs[quantized]
            if not views:
                continue
            buffer = views[0] if len(views) == 1 else torch.cat(views)
            config = self.config if quantized else self.config.with_(bits=32)
            allreduce(buffer, self.comm, op=op, config=config)
            if len(views) > 1:
                start = 0
                for view in views:
                    view.copy_(buffer[start : start + view.numel()])
                    start += view.numel()


def register_torch_backend() -> None:
    """Registers ``"cgx"`` with ``torch.distributed`` (idempotent)."""
    if BACKEND_NAME not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            BACKEND_NAME, CGXProcessGroup.create, extended_api=True, devices=["cpu", "cuda"]
        )
