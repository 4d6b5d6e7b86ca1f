"""Step layers of one structure, run as stacked weights: many steps in one batched product.

MGRIT relaxes every C-interval of a rank independently: the j-th step of each
interval is a different layer applied to a different state. When every step
layer is ``Linear(w, w)`` (optionally followed by the same elementwise
activation), those steps are one ``baddbmm`` over the stacked weights, instead
of one module call (and its Python dispatch) per step::

    rows x_i (n, B, w)   weights W_k (n, w, w) at k = k0, k0 + s, ...
    x_i + dt_i * act(b_k + x_i W_k^T)       one baddbmm, one act, one fused update

The adjoint needs, at each step k, the Jacobian of ``f_k`` at the stored forward
state ``x_k``; it does not depend on the step size, so one linearisation
``D_k = act'(z_k)`` of every local step (one batched forward) serves every
level and every adjoint iteration: an adjoint step is one ``bmm``,
``lam + dt (lam * D_k) W_k``, and the parameter gradients of the final sweep
are one more (``h (lam_{k+1} * D_k)^T x_k``), with no forward replayed.
The adjoint runs in reversed time, so its data are kept in reversed order
(row r is step ``stop - 1 - r``): its slices are then plain strided views.

On the fine split (see :mod:`mpx.mgrit.adjoint.halo`) a rank also steps from its last
point (layer ``stop``, the next block's first) in the forward solve and from
``first - 1`` (the previous block's last) in the adjoint: with those layers
given (``after``, ``before``), the forward weights have one row past the local
ones and the reversed data one row past theirs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from mpx.mgrit._torch_private import version

__all__ = ["ELEMENTWISE", "StackedSteps"]

#: Activations applied elementwise (so also to a stack of states), without parameters.
ELEMENTWISE: tuple[type[nn.Module], ...] = (
    nn.Tanh, nn.ReLU, nn.Sigmoid, nn.GELU, nn.SiLU, nn.LeakyReLU, nn.ELU, nn.Softplus,
    nn.Hardtanh, nn.Mish, nn.Tanhshrink, nn.Softsign, nn.Identity,
)  # fmt: skip


def _split(layer: nn.Module) -> tuple[nn.Linear, nn.Module | None] | None:
    """``(linear, activation)`` of a stackable step layer, else None."""
    if isinstance(layer, nn.Linear):
        return layer, None
    if type(layer) is nn.Sequential and 1 <= len(layer) <= 2 and isinstance(layer[0], nn.Linear):
        act = layer[1] if len(layer) == 2 else None
        if act is None or type(act) in ELEMENTWISE:
            return layer[0], act
    return None


def _in_place(act: nn.Module | None) -> Callable[[torch.Tensor], object]:
    """The activation applied in place (no result to copy back) where torch has it."""
    if act is None or type(act) is nn.Identity:
        return lambda z: z
    in_place = {nn.Tanh: torch.Tensor.tanh_, nn.Sigmoid: torch.Tensor.sigmoid_,
                nn.ReLU: torch.Tensor.relu_}.get(type(act))  # fmt: skip
    if in_place is not None:
        return in_place
    return lambda z: z.copy_(act(z))


def _derivative(act: nn.Module, z: torch.Tensor) -> torch.Tensor:
    """``act'(z)``, in z's memory where the formula is known (no autograd graph, no
    tensor of ones): tanh' = 1 - tanh^2, sigmoid' = (1 - s) s, relu' = [z > 0]."""
    kind = type(act)
    if kind is nn.Tanh:
        return z.tanh_().mul_(z).neg_().add_(1)  # z * z after tanh_: the same tensor
    if kind is nn.Sigmoid:
        s = z.sigmoid_()
        return torch.rsub(s, 1).mul_(s)
    if kind is nn.ReLU:
        return (z > 0).to(z.dtype)
    with torch.enable_grad():
        zr = z.requires_grad_(True)
        (d,) = torch.autograd.grad(act(zr), zr, torch.ones_like(z))
    return d


def _axpy(x: torch.Tensor, y: torch.Tensor, dt: torch.Tensor | float, n: int) -> None:
    """``y <- x + dt * y`` in place, dt a number or one per row of the n rows (the same
    two operations either way, so that a step's bits do not depend on which it got)."""
    y.mul_(dt if isinstance(dt, float) else dt.to(y.dtype).view(n, 1, 1)).add_(x)


def _hooked(module: nn.Module) -> bool:
    return any(
        m._forward_hooks or m._forward_pre_hooks or m._backward_hooks for m in module.modules()
    )


class StackedSteps:
    """The stacked weights of step layers that share one stackable structure.

    Built by :meth:`of`, which returns None unless every layer is ``Linear(w, w)``
    or ``Sequential(Linear(w, w), act)`` with the same activation (class and
    settings), dtype, device and bias, all parameters trainable and no hooks.

    Example::

        stacked = StackedSteps.of(layers)     # None: run the layers one by one
        stacked.refresh()                     # the weights as they are now
        y = stacked.step(x_rows, 0, 2, dt)    # steps 0, 2, 4, ... of the local layers
    """

    def __init__(
        self,
        linears: list[nn.Linear],
        act: nn.Module | None,
        before: nn.Linear | None = None,
        after: nn.Linear | None = None,
    ) -> None:
        self.linears, self.act = linears, act
        #: the layers of steps ``first - 1`` (adjoint) and ``stop`` (forward), if stepped
        self.before, self.after = before, after
        self.weight = torch.empty(0)
        self.bias: torch.Tensor | None = None
        #: how many times the weights were stacked (once per change of any of them)
        self.stacks = 0
        # (data pointer, version counter) of every parameter when last stacked.
        self._key: tuple[tuple[int, int], ...] | None = None
        # Reversed-order data of the last linearisation (see the module doc); the
        # reversed weights are kept with the stacked ones, for the same key.
        self._w_rev = torch.empty(0)
        self._w_rev_key: tuple[tuple[int, int], ...] | None = None
        self._b_rev: torch.Tensor | None = None
        self._x_rev = torch.empty(0)
        self._d_rev: torch.Tensor | None = None
        # Scratch tensors of the adjoint's ``lam * act'(z)``, one per shape.
        self._scratch: dict[tuple[int, ...], torch.Tensor] = {}
        self._act_ = _in_place(act)

    @staticmethod
    def of(
        layers: Sequence[nn.Module],
        before: nn.Module | None = None,
        after: nn.Module | None = None,
    ) -> StackedSteps | None:
        """The stacked form of ``layers`` (and of the neighbours' ``before`` and ``after``
        copies, which must stack with them), or None if they cannot be stacked."""
        halo = [m for m in (before, after) if m is not None]
        parts = [_split(layer) for layer in [*layers, *halo]]
        if not parts or any(p is None for p in parts) or any(_hooked(m) for m in layers):
            return None
        linears = [p[0] for p in parts if p is not None]
        acts = [p[1] for p in parts if p is not None]
        first, act = linears[0], acts[0]

        def signature(lin: nn.Linear) -> tuple[object, ...]:
            b = lin.bias
            return (lin.weight.shape, lin.weight.dtype, lin.weight.device, b is None,
                    lin.weight.requires_grad, b is None or b.requires_grad)  # fmt: skip

        sig = signature(first)
        if first.in_features != first.out_features or not first.weight.requires_grad:
            return None
        if any(signature(lin) != sig for lin in linears) or (
            first.bias is not None and not first.bias.requires_grad
        ):
            return None
        describe = [(type(a), a.extra_repr()) if a is not None else None for a in acts]
        if any(d != describe[0] for d in describe):
            return None
        n = len(layers)
        rest = linears[n:]
        return StackedSteps(
            linears[:n],
            act,
            before=rest.pop(0) if before is not None else None,
            after=rest.pop(0) if after is not None else None,
        )

    def _all(self) -> list[nn.Linear]:
        return [*self.linears, *(m for m in (self.before, self.after) if m is not None)]

    def _parameters(self) -> list[torch.Tensor]:
        return [p for lin in self._all() for p in (lin.weight, lin.bias) if p is not None]

    def refresh(self) -> bool:
        """Stacks the layers' weights if any changed since the last stacking.

        A training step stacks them once: its forward and backward and the
        next forward until the optimizer's step (which bumps every changed
        parameter's version counter) all read the same weights.

        Returns:
            whether the weights were stacked now.
        """
        params = self._parameters()
        key = tuple((p.data_ptr(), version(p)) for p in params)
        if key == self._key and self.weight.numel() > 0:
            return False
        forward = [*self.linears, *([self.after] if self.after is not None else [])]
        with torch.no_grad():
            self.weight = torch.stack([lin.weight.detach() for lin in forward])
            biases = [lin.bias.detach() for lin in forward if lin.bias is not None]
            self.bias = torch.stack(biases) if biases else None
        self._key, self.stacks = key, self.stacks + 1
        return True

    def _rows(self, x: torch.Tensor, out: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
        n, w = x.shape[0], self.weight.shape[-1]
        # Views: a level's rows are strided, each state (batch, width) contiguous.
        return n, x.view(n, -1, w), out.view(n, -1, w)

    def step(self, x: torch.Tensor, k0: int, stride: int, dt: torch.Tensor | float) -> torch.Tensor:
        """``x_i + dt_i f_k(x_i)`` for the rows of ``x``, local steps ``k0, k0 + stride, ...``."""
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        self.step_into(x, k0, stride, dt, out)
        return out

    def step_into(
        self, x: torch.Tensor, k0: int, stride: int, dt: torch.Tensor | float, out: torch.Tensor
    ) -> None:
        """:meth:`step` written into ``out`` (rows of a level: no result to copy in)."""
        n, x3, o3 = self._rows(x, out)
        # One kernel for any number of rows (also the coarsest level's single rows), so
        # that a step is the same bits whichever call makes it: a one-level solve's
        # residual is then exactly 0.
        ks = slice(k0, k0 + (n - 1) * stride + 1, stride)
        torch.bmm(x3, self.weight[ks].transpose(1, 2), out=o3)
        if self.bias is not None:
            o3.add_(self.bias[ks].unsqueeze(1))
        self._act_(o3)
        _axpy(x3, o3, dt, n)

    def linearize(self, states: torch.Tensor, before: torch.Tensor | None = None) -> None:
        """Keeps ``act'(z_k)`` at the states of the local steps (rows ``0..n-1`` of ``states``)
        and, given ``before`` (the state ``x_{first-1}``), of the step before them."""
        n, w = len(self.linears), self.weight.shape[-1]
        if self._w_rev_key != self._key or self._w_rev.numel() == 0:
            rev = [*self.linears[::-1], *([self.before] if self.before is not None else [])]
            with torch.no_grad():
                self._w_rev = torch.stack([lin.weight.detach() for lin in rev])
                biases = [lin.bias.detach() for lin in rev if lin.bias is not None]
            self._b_rev = torch.stack(biases) if biases else None
            self._w_rev_key = self._key
        self._x_rev = states[:n].reshape(n, -1, w).flip(0)
        rows = n
        if before is not None and self.before is not None:
            self._x_rev = torch.cat([self._x_rev, before.reshape(1, -1, w)])
            rows = n + 1
        z = torch.bmm(self._x_rev, self._w_rev[:rows].transpose(1, 2))
        if self._b_rev is not None:
            z += self._b_rev[:rows].unsqueeze(1)
        if self.act is None or type(self.act) is nn.Identity:
            self._d_rev = None
            return
        self._d_rev = _derivative(self.act, z)

    def release(self) -> None:
        """Drops the linearisation (after the backward pass)."""
        self._x_rev, self._d_rev = torch.empty(0), None
        self._scratch.clear()

    def _dlam(self, lam3: torch.Tensor, rs: slice) -> torch.Tensor:
        return lam3 if self._d_rev is None else lam3 * self._d_rev[rs]

    def adjoint(
        self, lam: torch.Tensor, r0: int, stride: int, dt: torch.Tensor | float
    ) -> torch.Tensor:
        """``lam + dt J_k^T lam`` for reversed rows ``r0, r0 + stride, ...`` (see linearize)."""
        out = torch.empty_like(lam, memory_format=torch.contiguous_format)
        self.adjoint_into(lam, r0, stride, dt, out)
        return out

    def adjoint_into(
        self, lam: torch.Tensor, r0: int, stride: int, dt: torch.Tensor | float, out: torch.Tensor
    ) -> None:
        """:meth:`adjoint` written into ``out``."""
        n, lam3, o3 = self._rows(lam, out)
        rs = slice(r0, r0 + (n - 1) * stride + 1, stride)
        src = lam3
        if self._d_rev is not None:
            # lam * act'(z) into a kept scratch tensor (the product needs its own memory).
            shape = tuple(lam3.shape)
            src = self._scratch.get(shape, lam3)
            if src is lam3:
                src = self._scratch[shape] = torch.empty(
                    shape, dtype=lam3.dtype, device=lam3.device
                )
            torch.mul(lam3, self._d_rev[rs], out=src)
        torch.bmm(src, self._w_rev[rs], out=o3)
        _axpy(lam3, o3, dt, n)

    def gradients(
        self, lams: torch.Tensor, h: float
    ) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
        """Parameter gradients of every local step from ``lam_{k+1}`` in reversed order.

        Returns:
            per local step (in order) its gradients in ``parameters()`` order, and
            ``J_0^T lam_1 + lam_1`` of the first local step (dL/dx of its input).
        """
        n, w = len(self.linears), self.weight.shape[-1]
        lam3 = lams[:n].reshape(n, -1, w)
        d = self._dlam(lam3, slice(0, n))
        g_w = torch.bmm(d.transpose(1, 2), self._x_rev[:n]).mul_(h)
        g_b = d.sum(1).mul_(h) if self.bias is not None else None
        grads = []
        for k in range(n):
            r = n - 1 - k
            grads.append([g_w[r]] if g_b is None else [g_w[r], g_b[r]])
        first = torch.mm(d[n - 1], self._w_rev[n - 1]).mul_(h).add_(lam3[n - 1])
        return grads, first.reshape(lams.shape[1:])
