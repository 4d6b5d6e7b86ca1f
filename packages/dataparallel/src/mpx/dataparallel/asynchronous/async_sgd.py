"""Asynchronous SGD on a :class:`ParameterServer`: Downpour and EASGD (TorchMPI's modes).

No rank waits for the others: each trains on its own data and meets the
others only through the server. Per client, every ``step()``::

    DownpourSGD (Dean et al., 2012)            EASGD (Zhang et al., 2015)
    --------------------------------           --------------------------------------
    x   <- x - lr * g        (local)           x <- x - lr * g             (local)
    acc <- acc - lr * g                        every tau steps:
    every push_every: push(acc, "add")           c    = pull()             (center)
                      acc <- 0                   d    = alpha * (x - c)
    every pull_every: x <- pull()                x    <- x - d
                                                 push(d, "add")            (c <- c + d)

Pushes are asynchronous (their handles are waited one round later); pulls
block, but only on this rank. The server holds one tensor per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mpx.dataparallel.asynchronous.parameter_server import ParameterServer, PSHandle
from mpx.dataparallel.errors import DataParallelTypeError, DataParallelValueError
from mpx.dataparallel.synchronous import broadcast_tensors

__all__ = ["EASGD", "DownpourSGD"]


class _ServerOptimizer(torch.optim.Optimizer):
    """Shared set-up: root's initial values everywhere, one server tensor per parameter."""

    def __init__(
        self, params: Iterable[nn.Parameter], server: ParameterServer, defaults: dict[str, Any]
    ) -> None:
        if not isinstance(server, ParameterServer):
            raise DataParallelTypeError(
                f"server must be a ParameterServer, got {type(server).__name__}; create one "
                "with ParameterServer() on every rank"
            )
        if defaults["lr"] <= 0:
            raise DataParallelValueError(f"lr must be positive, got {defaults['lr']!r}")
        super().__init__(params, defaults)
        self.server = server
        self._params = [p for g in self.param_groups for p in g["params"]]
        # Every client starts from root's values, and so does the server.
        broadcast_tensors(self._params, 0, comm=server.comm)
        self._keys = [server.register(p.detach()) for p in self._params]
        self._steps = 0
        self._pushes: list[PSHandle[None]] = []

    def _push(self, p: torch.Tensor, key: int, delta: torch.Tensor) -> None:
        self._pushes.append(self.server.push(key, delta, "add", async_op=True))

    def _wait_pushes(self) -> None:
        for handle in self._pushes:
            handle.wait()
        self._pushes.clear()

    def pull_parameters(self) -> None:
        """Fences the server (collective) and loads its values into the parameters."""
        self._wait_pushes()
        self.server.fence()
        with torch.no_grad():
            for p, key in zip(self._params, self._keys, strict=True):
                self.server.pull(key, out=p)


class DownpourSGD(_ServerOptimizer):
    """Downpour SGD: push accumulated updates, pull fresh parameters, never wait for peers.

    Args:
        params: the model's parameters.
        server: the :class:`ParameterServer` (created on every rank).
        lr: learning rate (applied locally and to the pushed updates).
        push_every: steps between pushes of the accumulated update.
        pull_every: steps between pulls of the server's parameters.

    Example::

        opt = DownpourSGD(model.parameters(), ParameterServer(), lr=0.05)
        loss.backward(); opt.step()
        opt.pull_parameters()              # collective, at the end: the server's values
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        server: ParameterServer,
        lr: float,
        push_every: int = 1,
        pull_every: int = 1,
    ) -> None:
        for name, value in (("push_every", push_every), ("pull_every", pull_every)):
            if not isinstance(value, int) or value < 1:
                raise DataParallelValueError(f"{name} must be an int >= 1, got {value!r}")
        super().__init__(params, server, {"lr": lr})
        self.push_every, self.pull_every = push_every, pull_every
        self._accumulated = [torch.zeros_like(p, device="cpu") for p in self._params]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        lr = self.param_groups[0]["lr"]
        for p, acc in zip(self._params, self._accumulated, strict=True):
            if p.grad is None:
                continue
            p.add_(p.grad, alpha=-lr)
            acc.add_(p.grad.cpu(), alpha=-lr)
        self._steps += 1
        if self._steps % self.push_every == 0:
            self._wait_pushes()  # the previous round's copies are done
            for p, key, acc in zip(self._params, self._keys, self._accumulated, strict=True):
                self._push(p, key, acc)
                acc.zero_()
        if self._steps % self.pull_every == 0:
            for p, key in zip(self._params, self._keys, strict=True):
                self.server.pull(key, out=p)
        return loss


class EASGD(_ServerOptimizer):
    """Elastic averaging SGD: local SGD, pulled toward a center variable every ``tau`` steps.

    Args:
        params: the model's parameters.
        server: the :class:`ParameterServer` holding the center variable.
        lr: local learning rate.
        tau: steps between elastic updates (communication period).
        alpha: moving rate; ``0.9 / world size`` by default (the paper's beta = 0.9).

    Example::

        opt = EASGD(model.parameters(), ParameterServer(), lr=0.05, tau=4)
        loss.backward(); opt.step()
        opt.pull_parameters()              # collective: the center variable
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        server: ParameterServer,
        lr: float,
        tau: int = 1,
        alpha: float | None = None,
    ) -> None:
        if not isinstance(tau, int) or tau < 1:
            raise DataParallelValueError(f"tau must be an int >= 1, got {tau!r}")
        if not isinstance(server, ParameterServer):
            raise DataParallelTypeError(
                f"server must be a ParameterServer, got {type(server).__name__}; create one "
                "with ParameterServer() on every rank"
            )
        alpha = 0.9 / server.size if alpha is None else alpha
        if not 0 < alpha < 1:
            raise DataParallelValueError(f"alpha must be in (0, 1), got {alpha!r}")
        super().__init__(params, server, {"lr": lr})
        self.tau, self.alpha = tau, alpha

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = closure() if closure is not None else None
        lr = self.param_groups[0]["lr"]
        for p in self._params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
        self._steps += 1
        if self._steps % self.tau == 0:
            self._wait_pushes()
            for p, key in zip(self._params, self._keys, strict=True):
                center = self.server.pull(key)
                delta = (p.detach().cpu() - center.view(p.shape)) * self.alpha
                p.sub_(delta.to(p.device))
                self._push(p, key, delta)
        return loss
