"""Weight prediction: the weights a stage will have ``d`` optimizer steps from now.

A forward on a stage with staleness ``d`` meets weights that are ``d`` updates
older than those its backward's gradient will be applied to. Prediction runs
the forward on an estimate of those future weights instead, from the
optimizer's state alone (future gradients taken as zero).

``msnag`` (the closed forms)::

    SGD, momentum γ, buffer v:   θ̂ = θ − Σ_{s=1..d} η_s · γ^s · v
                                   (= θ − η·v·(γ − γ^{d+1})/(1 − γ) for a constant η;
                                    γ^{s+1} with Nesterov)
    Adam/AdamW, step t, m, v:    for s = 1..d:
                                   θ ← θ − η_s/(1−β1^{t+s}) · β1^s·m / (√v/√(1−β2^{t+s}) + ε)

``aggmsnag`` unrolls the optimizer itself ``d`` times with the gradient
``g_1`` = the partly accumulated gradient (``step_every`` > 1) and
``g_s = 0`` after, weight decay included (SGD: ``d_p = g_s + λθ̂;
v̂ = γv̂ + (1−dampening)·d_p; θ̂ −= η_s·v̂``; Adam and AdamW likewise, their
second moment decaying too): exactly the weights ``d`` steps of that
optimizer would give with those gradients.

``η_s`` is the learning rate of the s-th future step: the current one without
a scheduler; with one, a copy of the scheduler (attached to a stand-in for the
optimizer) is stepped to read them (:func:`future_lrs`).
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch

from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = ["PREDICTIONS", "future_lrs", "optimizer_kind", "predict"]

PREDICTIONS = ("msnag", "aggmsnag")


def optimizer_kind(optimizer: torch.optim.Optimizer) -> str:
    """``"sgd"`` or ``"adam"`` (Adam and AdamW); refuses what prediction cannot follow."""
    if isinstance(optimizer, torch.optim.Adam):  # AdamW derives from Adam
        kind = "adam"
    elif isinstance(optimizer, torch.optim.SGD):
        kind = "sgd"
    else:
        raise PipelineTypeError(
            f"weight prediction and gap aware support SGD, Adam and AdamW, not "
            f"{type(optimizer).__name__}"
        )
    for group in optimizer.param_groups:
        if group.get("maximize") or group.get("amsgrad"):
            raise PipelineValueError(
                "weight prediction and gap aware do not support maximize=True or amsgrad=True; "
                "set them to False or pass weight_prediction=None, gap_aware=None"
            )
    return kind


def _decoupled(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    return isinstance(optimizer, torch.optim.AdamW) or bool(group.get("decoupled_weight_decay"))


class _StandIn:
    """What a scheduler sees of an optimizer: its param groups (without params)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": []}
            for g in optimizer.param_groups
        ]
        self.defaults = dict(optimizer.defaults)

    def step(self) -> None:
        return None


def future_lrs(optimizer: torch.optim.Optimizer, scheduler: Any, steps: int) -> list[list[float]]:
    """``lrs[s][group]``: the rate of the (s+1)-th next optimizer step."""
    now = [float(g["lr"]) for g in optimizer.param_groups]
    if scheduler is None or steps <= 1:
        return [now] * steps
    stand_in = _StandIn(optimizer)
    twin = copy.deepcopy(scheduler, memo={id(optimizer): stand_in})
    lrs = [now]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "scheduler stepped before the optimizer"
        for _ in range(steps - 1):
            twin.step()
            lrs.append([float(g["lr"]) for g in stand_in.param_groups])
    return lrs


def predict(
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    steps: int,
    mode: str,
    lrs: list[list[float]] | None = None,
) -> dict[torch.nn.Parameter, torch.Tensor]:
    """Predicted values of ``params`` after ``steps`` optimizer steps (new tensors).

    Args:
        optimizer: owns ``params``; its state is read, never changed.
        steps: staleness ``d`` (0 returns copies of the current values).
        mode: ``"msnag"`` or ``"aggmsnag"``.
        lrs: per future step and param group; the current rates if None.
    """
    if mode not in PREDICTIONS:
        raise PipelineValueError(
            f"weight_prediction={mode!r} is not one of {', '.join(PREDICTIONS)} (or None)"
        )
    kind = optimizer_kind(optimizer)
    if lrs is None:
        lrs = future_lrs(optimizer, None, steps)
    wanted = {id(p) for p in params}
    out: dict[torch.nn.Parameter, torch.Tensor] = {}
    with torch.no_grad():
        for gi, group in enumerate(optimizer.param_groups):
            etas = [lr[gi] for lr in lrs]
            for p in group["params"]:
                if id(p) not in wanted:
                    continue
                state = optimizer.state.get(p, {})
                if kind == "sgd":
                    out[p] = _sgd(p, state, group, etas, mode)
                else:
                    out[p] = _adam(p, state, group, etas, mode, _decoupled(optimizer, group))
    missing = [tuple(p.shape) for p in params if p not in out]
    if missing:
        raise PipelineValueError(
            f"parameters of shapes {missing} are not in the optimizer; build it over "
            "pipe.parameters() (this stage's parameters)"
        )
    return out


def _sgd(
    p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], etas: list[float], mode: str
) -> torch.Tensor:
    gamma, nesterov = float(group["momentum"]), bool(group["nesterov"])
    buf = state.get("momentum_buffer")
    theta = p.detach().clone()
    if mode == "msnag":
        if buf is None or gamma == 0:
            return theta
        for s, eta in enumerate(etas, start=1):
            theta.sub_(buf, alpha=eta * gamma ** (s + 1 if nesterov else s))
        return theta
    wd, damp = float(group["weight_decay"]), float(group["dampening"])
    v = None if buf is None else buf.detach().clone()
    for s, eta in enumerate(etas, start=1):
        d_p = p.grad.detach().clone() if (s == 1 and p.grad is not None) else torch.zeros_like(p)
        if wd:
            d_p.add_(theta, alpha=wd)
        if gamma:
            if v is None:
                v = d_p.clone()
            else:
                v.mul_(gamma).add_(d_p, alpha=1 - damp)
            d_p = d_p.add(v, alpha=gamma) if nesterov else v
        theta.sub_(d_p, alpha=eta)
    return theta


def _adam(
    p: torch.Tensor,
    state: dict[str, Any],
    group: dict[str, Any],
    etas: list[float],
    mode: str,
    decoupled: bool,
) -> torch.Tensor:
    beta1, beta2 = (float(b) for b in group["betas"])
    eps, wd = float(group["eps"]), float(group["weight_decay"])
    t = int(state["step"]) if "step" in state else 0
    theta = p.detach().clone()
    if mode == "msnag":
        if t == 0:
            return theta
        m, v = state["exp_avg"], state["exp_avg_sq"]
        for s, eta in enumerate(etas, start=1):
            denom = v.sqrt() / (1 - beta2 ** (t + s)) ** 0.5 + eps
            theta.addcdiv_(m, denom, value=-eta * beta1**s / (1 - beta1 ** (t + s)))
        return theta
    m = state["exp_avg"].detach().clone() if t else torch.zeros_like(p)
    v = state["exp_avg_sq"].detach().clone() if t else torch.zeros_like(p)
    for s, eta in enumerate(etas, start=1):
        g = p.grad.detach().clone() if (s == 1 and p.grad is not None) else torch.zeros_like(p)
        if wd and decoupled:
            theta.mul_(1 - eta * wd)
        elif wd:
            g.add_(theta, alpha=wd)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        step = t + s
        denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
        theta.addcdiv_(m, denom, value=-eta / (1 - beta1**step))
    return theta
