"""``QuantizeState``: what the compressed allreduce keeps between calls.

One per training job (or per communicator): the configuration, the
communicator, the generator of the stochastic-rounding seeds (seeded by
``config.seed`` and the rank, so runs repeat and ranks draw independent
noise), the error-feedback residuals, parameter names for layer filtering,
and byte counters.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mpx.quantize.reduction.config import CompressionConfig, registry

if TYPE_CHECKING:
    from mpx.collectives import CommLike, Communicator

__all__ = ["Choice", "QuantizeState"]


@dataclass(frozen=True)
class Choice:
    """What ``CompressionConfig(when="auto")`` decided for buffers of one size, and from what.

    Attributes:
        compressed: whether they are quantized.
        plain_s: the slowest rank's best time of the uncompressed allreduce (seconds).
        compressed_s: the same for the compressed one.
    """

    compressed: bool
    plain_s: float
    compressed_s: float


class QuantizeState:
    """State of the compressed allreduce, and the ``state`` of :func:`ddp_comm_hook`.

    Args:
        config: the compression settings (default: :meth:`CompressionConfig.from_env`).
        comm: the mpx communicator (default: ``mpx.collectives.world()``).
        model: a module whose parameter names drive layer filtering
            (``config.exclude``, :func:`exclude_layer`).

    Attributes:
        residuals: error-feedback residuals (float32) by tensor key.
        bytes_sent: bytes this rank handed to the network so far, compressed and not.
        bytes_uncompressed: what the same calls would have sent in full precision.
        choices: with ``config.when == "auto"``, what was measured and decided for
            each buffer size (:class:`Choice`; :mod:`mpx.quantize.compression_choice`).

    Example::

        state = QuantizeState(CompressionConfig(bits=4), model=model)
        ddp.register_comm_hook(state, ddp_comm_hook)
        print(state.bytes_sent / state.bytes_uncompressed)
    """

    def __init__(
        self,
        config: CompressionConfig | None = None,
        comm: CommLike | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        self.config = CompressionConfig.from_env() if config is None else config
        self._comm: Communicator | None = None
        if comm is not None:
            from mpx.collectives import as_communicator  # mpi4py communicators too

            self._comm = as_communicator(comm)
        self._generator: torch.Generator | None = None
        self.residuals: dict[Hashable, torch.Tensor] = {}
        self.names: dict[int, str] = {}
        if model is not None:
            self.names.update({id(p): name for name, p in model.named_parameters()})
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        # CompressionConfig(when="auto")'s decisions, by buffer size, dtype, device, op.
        self.choices: dict[Hashable, Choice] = {}

    @property
    def comm(self) -> Communicator:
        if self._comm is None:
            from mpx.collectives import world

            self._comm = world()
        return self._comm

    @property
    def generator(self) -> torch.Generator:
        """The seed source of stochastic rounding: ``config.seed`` and the rank."""
        if self._generator is None:
            seed = self.config.seed * 1_000_003 + self.comm.rank + 1
            self._generator = torch.Generator().manual_seed(seed)
        return self._generator

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to quantize as this one would have: this rank's
        stochastic-rounding generator and its error-feedback residuals.

        Per rank (the generator is seeded by the rank): save every rank's, e.g.
        with ``mpx.dataparallel.save_resumable``, which does so for a
        ``DistributedOptimizer``'s. Residual keys must be names (the default
        key of :func:`allreduce`, a storage address, means nothing in another
        process): pass ``key=`` or ``names=`` where error feedback is resumed.
        """
        return {
            "generator": self.generator.get_state(),
            "residuals": [[k, r.cpu()] for k, r in self.residuals.items()],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`'s generator and residuals."""
        self.generator.set_state(state["generator"])
        # On the CPU: residual() moves each to its tensor's device at first use.
        self.residuals = {k: r for k, r in state["residuals"]}

    def name_of(self, param: torch.Tensor) -> str | None:
        """The parameter's name, from ``model`` or :func:`register_model`."""
        return self.names.get(id(param)) or registry.name_of(param)

    def residual(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The float32 error-feedback residual of ``key`` (zeros at first)."""
        res = self.residuals.get(key)
        if res is not None and res.numel() == like.numel() and res.device != like.device:
            res = self.residuals[key] = res.to(like.device)  # loaded by load_state_dict
        if res is None or res.numel() != like.numel() or res.device != like.device:
            res = torch.zeros(like.numel(), dtype=torch.float32, device=like.device)
            self.residuals[key] = res
        return res
