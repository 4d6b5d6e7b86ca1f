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
from mpx.quantize.cgx.buckets import BucketMatcher, Segments
from mpx.quantize.cgx.cgx_layers import EnvConfig, LayerSpec, layer_table
from mpx.quantize.codec import FLOAT_DTYPES
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.reduction import CompressionConfig, allreduce, registry

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "register_torch_backend"]

BACKEND_NAME = "cgx"


class CGXProcessGroup(MPXProcessGroup):
    """The ``"cgx"`` group: floating all_reduce quantized per the CGX configuration.

    Attributes:
        config: the compression settings, read from the environment as it is
            at each all_reduce, as CGX (``CompressionConfig.from_env()``; 32
            bits, i.e. no quantization, when no bits variable is set).
        layers: maps buckets to the layers of ``register_model`` (layer filtering).
    """

    def __init__(self, comm: Communicator, timeout: timedelta | None = None) -> None:
        super().__init__(comm, timeout)
        self._env = EnvConfig()
        self._env.current()  # a bad variable is an error when the group is made
        self.layers = BucketMatcher()

    @property
    def config(self) -> CompressionConfig:
        """The configuration the ``CGX_*``/``MPX_QUANTIZE_*`` variables give now."""
        return self._env.current()

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> MPXWork:  # type: ignore[override]
        opts = op if op is not None else opts
        listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        name = self.reduce_op_name(opts, "allreduce")
        t = listed[0]
        config = self.config  # CGX reads its variables at every all_reduce
        floating = (
            len(listed) == 1
            and name in ("sum", "avg")
            and t.dtype in FLOAT_DTYPES
            and not t.is_sparse
        )
        if floating and layer_table.active():  # torch_cgx.register_layer: per-layer bits
            specs = layer_table.next_bucket(t.numel())
            if specs is not None:
                self._reduce_layers(t, specs, config, name)
                return self._work([], listed)
        if not (floating and config.enabled and t.numel() >= config.min_compressed):
            return super().allreduce(listed, opts)  # exact: mpx's own
        # The work is made by the group (``_work``), as the exact path's: it carries
        # the group's timeout and hands torch's C++ tensor-list futures only where
        # the group has a C++ reader of lists (``cpp_reads_lists``: a built-in comm
        # hook), not a TorchScript task per DDP bucket always.
        if not self.layers.active():  # no layers registered: the tensor as a whole
            self._check_no_exclusion(t.numel(), config)
            allreduce(t, self.comm, op=name, config=config)
            return self._work([], listed)
        segments = self.layers.segments(t.numel(), config)
        if not any(quantized for _, quantized in segments):
            return super().allreduce(listed, opts)
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        self._reduce_segments(flat, segments, name, config)
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))
        return self._work([], listed)

    def _check_no_exclusion(self, numel: int, config: CompressionConfig) -> None:
        """Raises where layers are to be excluded by name but none are registered.

        A bucket is known by its layers' sizes only after ``register_model``;
        without it an exclusion (``exclude_layer``, ``MPX_QUANTIZE_EXCLUDE``)
        would be skipped in silence and the excluded layers quantized.
        """
        excluded = (*config.exclude, *registry.excluded)
        if excluded:
            raise QuantizeValueError(
                f"the cgx group: layers {list(excluded)} are to be excluded by name, but no "
                f"layers are registered, so this tensor of {numel} elements would be "
                "quantized whole; call torch_cgx.register_model([(name, p.numel()) for name, "
                "p in model.named_parameters()]) (or mpx.quantize.register_model(model)) first"
            )

    def _reduce_segments(
        self, flat: torch.Tensor, segments: Segments, op: str, config: CompressionConfig
    ) -> None:
        """Reduces the quantized runs of ``flat`` together, then the exact ones, in place."""
        exact = config.with_(bits=32)
        self._reduce_runs(flat, [(n, config if q else exact) for n, q in segments], op)

    def _reduce_layers(
        self, t: torch.Tensor, specs: list[LayerSpec], config: CompressionConfig, op: str
    ) -> None:
        """Reduces a bucket of ``register_layer`` layers, each at its own bits and bucket size.

        As CGX: a layer is quantized when its bits are 1-8 and it has at least
        the minimal size (never below 16 elements); the others are exact.
        """
        runs = []
        for spec in specs:
            layer = spec.config(config)
            runs.append((spec.numel, layer if layer.compresses(spec.numel) else None))
        flat = t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)
        exact = config.with_(bits=32)
        self._reduce_runs(flat, [(n, c if c is not None else exact) for n, c in runs], op)
        if not t.is_contiguous():
            t.copy_(flat.view(t.shape))

    def _reduce_runs(
        self, flat: torch.Tensor, runs: list[tuple[int, CompressionConfig]], op: str
    ) -> None:
        """Reduces the runs of ``flat`` that share a configuration together, in place.

        The configurations in a fixed order (quantized by bits and bucket size,
        then exact): every rank has the same runs, so makes the same calls.
        """
        groups: dict[CompressionConfig, list[torch.Tensor]] = {}
        offset = 0
        for length, run_config in runs:
            groups.setdefault(run_config, []).append(flat[offset : offset + length])
            offset += length
        for run_config in sorted(groups, key=lambda c: (not c.enabled, c.bits, c.bucket_size)):
            views = groups[run_config]
            buffer = views[0] if len(views) == 1 else torch.cat(views)
            allreduce(buffer, self.comm, op=op, config=run_config)
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
