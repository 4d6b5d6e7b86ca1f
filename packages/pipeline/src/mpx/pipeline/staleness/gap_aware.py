"""Gap aware (Barkai, Hakimi, Schuster, ICLR 2020): damp gradients by their staleness gap.

Per element, after every optimizer step::

    A ← 0.999·A + 0.001·u²          u = SGD's momentum buffer (the gradient
                                        without momentum); Adam: the step applied
    C = η_max·(√(A/(1−0.999^t)) + 1e-8)   SGD  (η_max: the largest rate so far)
    C = √(A/(1−0.999^t)) + 1e-8          Adam/AdamW

and for a gradient computed on weights ``θ_used`` while the weights are now
``θ_now``::

    Δ = |θ_now − θ_used|,   Φ = 1 + Δ/C,   g ← g/Φ

Coupled weight decay (SGD, Adam) is damped as well: before the step the
gradient gets ``λθ·(1/Φ − 1)``, so that the optimizer's own ``+λθ`` makes
``(g + λθ)/Φ``. Before the first step there is no ``A``: Φ = 1.
"""

from __future__ import annotations

from typing import Any

import torch

from mpx.pipeline.errors import PipelineError
from mpx.pipeline.staleness.prediction import _decoupled, optimizer_kind

__all__ = ["GAP_AWARE", "GapAware"]

GAP_AWARE = ("ga", "ga_jfl")
_BETA = 0.999


class GapAware:
    """Running statistics and penalties for the parameters of one optimizer.

    Example::

        ga = GapAware(optimizer)
        grad = grad / ga.penalty(p, weights_used)
        ga.after_step(optimizer, before)
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.kind = optimizer_kind(optimizer)
        self.mean_sq: dict[torch.Tensor, torch.Tensor] = {}
        self.t = 0
        self.eta_max = 0.0
        self.last_penalty: dict[torch.Tensor, torch.Tensor] = {}

    def state_dict(self, params: list[torch.Tensor]) -> dict[str, Any]:
        """The running statistics, in the order of ``params`` (tensors are no keys on disk)."""
        return {
            "t": self.t,
            "eta_max": self.eta_max,
            "mean_sq": [self.mean_sq.get(p) for p in params],
        }

    def load_state_dict(self, state: dict[str, Any], params: list[torch.Tensor]) -> None:
        """Restores :meth:`state_dict` onto ``params`` (the same model, the same order)."""
        self.t, self.eta_max = int(state["t"]), float(state["eta_max"])
        self.mean_sq = {
            p: a.to(p.device)
            for p, a in zip(params, state["mean_sq"], strict=True)
            if a is not None
        }
        self.last_penalty.clear()

    def scale(self, p: torch.Tensor) -> torch.Tensor | None:
        """``C`` of ``p``; None before the first step."""
        if self.t == 0 or p not in self.mean_sq:
            return None
        rms = (self.mean_sq[p] / (1 - _BETA**self.t)).sqrt() + 1e-8
        return rms * self.eta_max if self.kind == "sgd" else rms

    def penalty(self, p: torch.Tensor, used: torch.Tensor) -> torch.Tensor | float:
        """Φ for a gradient of ``p`` computed on ``used``; remembered for weight decay."""
        c = self.scale(p)
        phi: torch.Tensor | float = 1.0 if c is None else 1 + (p.detach() - used).abs() / c
        if isinstance(phi, torch.Tensor):
            self.last_penalty[p] = phi
        return phi

    def damp_weight_decay(self, optimizer: torch.optim.Optimizer) -> None:
        """Adds ``λθ(1/Φ − 1)`` to the gradients (coupled weight decay only)."""
        with torch.no_grad():
            for group in optimizer.param_groups:
                wd = float(group.get("weight_decay", 0.0))
                if not wd or _decoupled(optimizer, group):
                    continue
                for p in group["params"]:
                    if p.grad is None:
                        continue  # not stepping now: its penalty waits for its step
                    phi = self.last_penalty.pop(p, None)
                    if phi is not None:
                        p.grad.add_(p.detach() * wd * (1 / phi - 1))

    def after_step(
        self,
        optimizer: torch.optim.Optimizer,
        before: dict[torch.Tensor, torch.Tensor] | None,
        stepped: set[torch.Tensor] | None = None,
    ) -> None:
        """Updates ``A`` once the optimizer has stepped.

        Args:
            before: for Adam, each parameter's value before the step.
            stepped: the parameters that stepped (all by default): the
                asynchronous pipeline steps one chunk of a rank at a time.
        """
        self.t += 1
        with torch.no_grad():
            for group in optimizer.param_groups:
                self.eta_max = max(self.eta_max, float(group["lr"]))
                for p in group["params"]:
                    if stepped is not None and p not in stepped:
                        continue
                    if self.kind == "adam":
                        if before is None or p not in before:
                            raise PipelineError("internal: Adam gap aware needs the old weights")
                        u = before[p] - p.detach()
                    else:
                        buf = optimizer.state.get(p, {}).get("momentum_buffer")
                        if buf is not None:
                            u = buf
                        elif p.grad is not None:
                            u = p.grad
                        else:
                            continue
                    a = self.mean_sq.get(p)
                    if a is None:
                        a = self.mean_sq[p] = torch.zeros_like(p)
                    a.mul_(_BETA).addcmul_(u, u, value=1 - _BETA)
