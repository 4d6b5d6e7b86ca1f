"""One stage's layers and how a micro-batch runs through them.

Random numbers. Before layer ``i`` runs on micro-batch number ``g``, the
global CPU generator (and, for an input on a GPU, that device's generator) is
seeded with::

    layer_seed(seed, g, i) = ((seed * 1_000_003 + g) * 1_000_003 + i) mod 2**63

and the caller's generator state is restored when the stage is done. So a
layer's dropout mask depends only on (seed, micro-batch, layer), not on the
partition, the schedule, or whether this is the first forward or the
recomputation. ``g`` counts the micro-batches of every training call
(``step`` number × chunks + index in the step; the asynchronous schedule
numbers its stream the same way). The unpartitioned model therefore
reproduces a pipeline's draws by running each micro-batch through the layers
with those seeds (see ``tests/test_pipeline.py``).

BatchNorm. A recomputation is a second forward of the same micro-batch; it
must not move the running statistics again, so they are saved before it and
put back after (the first forward is the one that counts, in micro-batch order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from mpx.pipeline._torch_private import is_batchnorm
from mpx.pipeline.model.border import first_tensor, map_tensors
from mpx.pipeline.model.partition import has_inplace
from mpx.pipeline.model.skip import check_skips, tracking, uses_skips

__all__ = ["Stage", "Weights", "layer_seed"]

_MOD = 2**63
_PRIME = 1_000_003

Weights = dict[int, dict[str, torch.Tensor]]
"""Per global layer index, a tensor for each of the layer's parameter names."""


def cuda_generator(device: torch.device) -> torch.Generator:
    """The default generator of a CUDA device (the current one for ``cuda``)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def layer_seed(seed: int, microbatch: int, layer: int) -> int:
    """The seed of ``layer`` when it runs micro-batch number ``microbatch``."""
    return ((seed * _PRIME + microbatch) * _PRIME + layer) % _MOD


class Stage(nn.Module):
    """The consecutive layers ``[start, stop)`` of a sequential model.

    Example::

        stage = Stage(model, 2, 5, seed=0)
        y = stage.run(x, microbatch=0)
        stage.layer_modules()  # {2: ..., 3: ..., 4: ...}
    """

    def __init__(
        self,
        module: nn.Sequential,
        start: int,
        stop: int,
        seed: int,
        *,
        parts: list[tuple[int, int]] | None = None,
    ) -> None:
        super().__init__()
        # Virtual stages: a rank may hold several ranges of layers (its chunks);
        # ``run(..., part=k)`` runs the k-th.
        self.parts = list(parts) if parts is not None else [(start, stop)]
        self.start, self.stop, self.seed = self.parts[0][0], self.parts[-1][1], seed
        self._index = [i for a, b in self.parts for i in range(a, b)]
        self.layers = nn.ModuleList(module[i] for i in self._index)
        self._offset = [0]
        for a, b in self.parts:
            self._offset.append(self._offset[-1] + b - a)
        # With skip connections in the model a border is (output, {skip name:
        # tensor}): the skips stashed before it and popped after (see skip.py).
        self.skips = uses_skips(module)
        if self.skips:
            check_skips(list(module))
        self.part_first = [a == 0 for a, _ in self.parts]
        self.part_last = [b == len(module) for _, b in self.parts]
        self.first, self.last = self.part_first[0], self.part_last[-1]
        # An in-place first layer of a chunk would overwrite the received
        # activation (a leaf we need for the backward), so it gets a copy.
        self.copy_input = [has_inplace(module[a]) if b > a else False for a, b in self.parts]
        self.batchnorms = [m for m in self.layers.modules() if is_batchnorm(m)]
        # Called between layers (forward and backward): MPI moves a large
        # message only while its sender or receiver is inside an MPI call, so
        # a stage deep in compute would hold back the neighbour it just sent to.
        self.progress: Callable[[], None] | None = None

    def _progress_hook(self, grad: torch.Tensor) -> None:
        if self.progress is not None:
            self.progress()

    def layer_modules(self) -> dict[int, nn.Module]:
        return dict(zip(self._index, self.layers, strict=True))

    def part_modules(self, part: int) -> list[nn.Module]:
        """The layers of chunk ``part``, in order."""
        lo, hi = self._offset[part : part + 2]
        return list(self.layers[lo:hi])

    def named_layer_params(self, part: int | None = None) -> dict[int, dict[str, nn.Parameter]]:
        """Per global layer index, its parameters (of chunk ``part`` only, if given)."""
        lo, hi = (0, len(self.layers)) if part is None else self._offset[part : part + 2]
        return {self._index[k]: dict(self.layers[k].named_parameters()) for k in range(lo, hi)}

    def run(
        self,
        x: Any,
        microbatch: int,
        weights: Mapping[int, Mapping[str, torch.Tensor]] | None = None,
        part: int = 0,
    ) -> Any:
        """Runs ``x`` (a tensor or a border structure) through the layers with the seeds
        of ``microbatch``; each layer gets the previous one's output as its argument.

        Args:
            weights: run with these tensors instead of the layers' parameters.
            part: which of the rank's chunks (virtual stages) runs.
        """
        if self.copy_input[part]:
            x = map_tensors(torch.clone, x)
        skips: dict[str, torch.Tensor] = {}
        if self.skips and not self.part_first[part]:
            # A copy: a recomputation pops from the received skips again.
            x, received = x
            skips = dict(received)
        # The CPU generator, and the input's CUDA device's (dropout on a GPU
        # draws from it). Not torch.manual_seed: it queues seeding for every
        # CUDA device and records a stack trace each time (slow).
        generators = [torch.default_generator]
        on_gpu = first_tensor(x, lambda t: t.is_cuda)
        if on_gpu is not None:
            generators.append(cuda_generator(on_gpu.device))
        saved = [g.get_state() for g in generators]
        try:
            with tracking(skips):
                x = self._run_layers(x, microbatch, weights, generators, part)
        finally:
            for g, state in zip(generators, saved, strict=True):
                g.set_state(state)
        return (x, skips) if self.skips and not self.part_last[part] else x

    def _run_layers(
        self,
        x: Any,
        microbatch: int,
        weights: Mapping[int, Mapping[str, torch.Tensor]] | None,
        generators: list[torch.Generator],
        part: int,
    ) -> Any:
        lo, hi = self._offset[part], self._offset[part + 1]
        for k in range(lo, hi):
            layer, index = self.layers[k], self._index[k]
            for g in generators:
                g.manual_seed(layer_seed(self.seed, microbatch, index))
            if weights is None or index not in weights:
                x = layer(x)
            else:
                x = functional_call(layer, dict(weights[index]), (x,))
            if self.progress is not None and k < hi - 1:
                self.progress()
                hooked = first_tensor(x, lambda t: t.requires_grad)
                if hooked is not None:
                    # The same between layers of the backward.
                    hooked.register_hook(self._progress_hook)  # type: ignore[no-untyped-call]
        return x

    def save_statistics(self) -> list[dict[str, torch.Tensor]]:
        """Copies of the BatchNorm running statistics (small: a few floats per channel)."""
        return [
            {k: b.clone() for k, b in bn.named_buffers() if b is not None} for bn in self.batchnorms
        ]

    def restore_statistics(self, saved: list[dict[str, torch.Tensor]]) -> None:
        """Puts back what :meth:`save_statistics` returned."""
        # Through ``.data``: an unrecomputed micro-batch's graph holds these
        # buffers, and a tracked write would fail its backward's version check.
        for bn, buffers in zip(self.batchnorms, saved, strict=True):
            for k, b in bn.named_buffers():
                b.data.copy_(buffers[k])

    @contextlib.contextmanager
    def frozen_statistics(self) -> Iterator[None]:
        """BatchNorm running statistics are left as they were (for recomputation)."""
        saved = self.save_statistics()
        try:
            yield
        finally:
            self.restore_statistics(saved)
