"""The layers next to a rank's block: what its boundary steps need from its neighbours.

With the fine grid split freely over the ranks (see :mod:`mpx.mgrit.solver.grid` and
:mod:`mpx.mgrit.solver.boundaries`), every step a rank computes starts inside its
block ``[a, b)`` of steps, or at ``b`` (the forward solve: the step from its
last point, which it sends to its right neighbour), or at ``a - 1`` (the
adjoint, in reversed time: the same from the other side). So besides its own
layers a rank needs two copies, refreshed from their owners before every
forward pass (the owners' optimizer changes them), and in the adjoint the
forward state the step ``a - 1`` starts from::

    rank r-1: [... layer a-1]   rank r: [layer a ... layer b-1]   rank r+1: [layer b ...]
              --- copy of a-1 --->                  <--- copy of b ---
              --- x_{a-1} after the forward solve --->

The copies are not parameters of the network (they would appear in its
``state_dict`` and its optimizer twice); their values follow the owners' at
the start of each forward pass.

A ParallelGRU's steps share one set of weights: what its boundary steps need
is not a layer but the input row of the step (:meth:`StateHalo.share_edges`,
once per layer) and, in the adjoint, the forward state and the loss's
gradient at the point the step ``a - 1`` ends on (:meth:`StateHalo.share_forcing`).
:class:`StateHalo` carries those rows; :class:`LayerHalo` adds the layer copies.
"""

from __future__ import annotations

import torch
from torch import nn

from mpx.collectives import Channel, Communicator

__all__ = ["LayerHalo", "StateHalo", "module_tensors"]

# Message tags of the copies, apart from the solvers' (one per level and step of t0).
_TAG_FIRST, _TAG_LAST, _TAG_STATE = 30001, 30002, 30003
_TAG_FORCING, _TAG_EDGE_LEFT, _TAG_EDGE_RIGHT = 30004, 30005, 30006


def module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers, in ``state_dict`` order (what a copy needs)."""
    return [t.detach() for t in module.state_dict(keep_vars=True).values()]


class StateHalo:
    """The rows a rank's boundary steps need from its neighbours: the forward state
    before its block, the adjoint's source there, and (ParallelGRU) input rows.

    Args:
        comm: the solver's communicator.
        left, right: the ranks of the blocks before and after this one (None: none).

    Example::

        halo = StateHalo(comm, left, right)
        halo.share_state(states[-2])          # before an adjoint: x_{a-1} in .state
        halo.share_forcing(forcing[-1])       # before an adjoint: dL/dx_a in .forcing
        before, after = halo.share_edges(rows[0], rows[-1])
    """

    def __init__(self, comm: Communicator, left: int | None, right: int | None) -> None:
        self.channel = Channel(comm)
        self.left, self.right = left, right
        #: the forward state ``x_{a-1}`` of the running adjoint (None: none yet, or no left)
        self.state: torch.Tensor | None = None
        #: the loss's gradient at ``x_a`` (the left's last point) of the running adjoint
        self.forcing: torch.Tensor | None = None

    def refresh(self) -> None:
        """Before a forward solve: nothing (rows are shared as they are made; a
        :class:`LayerHalo` refreshes its layer copies here)."""

    def _shift(self, row: torch.Tensor | None, tag: int, to_right: bool) -> torch.Tensor | None:
        """Sends ``row`` to the right (or left) neighbour; returns the one the other sends."""
        source, target = (self.left, self.right) if to_right else (self.right, self.left)
        pending = None
        if source is not None and row is not None:
            like = [(row.shape, row.dtype)]
            pending = self.channel.expect(source, tag, like, device=row.device)
        sent = None
        if target is not None and row is not None:
            sent = self.channel.post(target, tag, row.detach().contiguous())
        got = None
        if pending is not None:
            message = self.channel.receive(pending)
            got = message.tensors[0].clone()
            self.channel.release(message.tensors)
        if sent is not None:
            self.channel.wait(sent)
        return got

    def share_state(self, last_state: torch.Tensor | None) -> None:
        """Sends ``x_{b-1}`` (this rank's last step's start) right and keeps the left
        neighbour's as :attr:`state` (the start of step ``a - 1``)."""
        self.state = self._shift(last_state, _TAG_STATE, to_right=True)

    def share_forcing(self, last_forcing: torch.Tensor | None) -> None:
        """Sends ``dL/dx_b`` (the source at this rank's last point) right and keeps the
        left neighbour's as :attr:`forcing` (the source step ``a - 1`` reads)."""
        self.forcing = self._shift(last_forcing, _TAG_FORCING, to_right=True)

    def share_edges(
        self, first_row: torch.Tensor | None, last_row: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(before, after)``: the left neighbour's last row and the right one's first,
        for this rank's first row sent left and last row sent right (None: no such
        neighbour). Not differentiable: the boundary steps are never differentiated."""
        before = self._shift(last_row, _TAG_EDGE_RIGHT, to_right=True)
        after = self._shift(first_row, _TAG_EDGE_LEFT, to_right=False)
        return before, after


class LayerHalo(StateHalo):
    """Copies of the neighbours' boundary layers, and the forward state before the block.

    Args:
        comm: the network's communicator.
        left, right: the ranks of the blocks before and after this one (None: none).
        first, last: this rank's first and last layer (sent left and right).
        before, after: modules shaped as layers ``a - 1`` and ``b`` (they receive the
            copies; None where there is no such neighbour).

    Example::

        halo = LayerHalo(comm, left, right, layers[0], layers[-1], before, after)
        halo.refresh()                 # before each forward: the neighbours' layers now
        halo.share_state(states[-2])   # before an adjoint: x_{b-1} right, x_{a-1} from the left
    """

    def __init__(
        self,
        comm: Communicator,
        left: int | None,
        right: int | None,
        first: nn.Module,
        last: nn.Module,
        before: nn.Module | None,
        after: nn.Module | None,
    ) -> None:
        super().__init__(comm, left, right)
        self.first, self.last = first, last
        self.before = before if left is not None else None
        self.after = after if right is not None else None

    def _follow(self, module: nn.Module, like: nn.Module) -> None:
        """Puts ``module`` on ``like``'s device and floating dtype (the network was moved)."""
        ref = next(iter(module_tensors(like)), None)
        if ref is None:
            return
        mine = next(iter(module_tensors(module)), None)
        if mine is not None and (mine.device, mine.dtype) != (ref.device, ref.dtype):
            if ref.is_floating_point():
                module.to(device=ref.device, dtype=ref.dtype)
            else:
                module.to(device=ref.device)

    def refresh(self) -> None:
        """Sends this rank's first layer left and last layer right; copies the neighbours'
        into ``after`` and ``before``. Collective between neighbours."""
        incoming = []
        for module, peer, tag in ((self.after, self.right, _TAG_FIRST),
                                  (self.before, self.left, _TAG_LAST)):  # fmt: skip
            if module is None or peer is None:
                continue
            self._follow(module, self.first)
            tensors = module_tensors(module)
            like = [(t.shape, t.dtype) for t in tensors]
            device = tensors[0].device if tensors else torch.device("cpu")
            pending = self.channel.expect(peer, tag, like, device=device)
            incoming.append((tensors, pending))
        sent = []
        if self.left is not None:
            sent.append(self.channel.post(self.left, _TAG_FIRST, module_tensors(self.first)))
        if self.right is not None:
            sent.append(self.channel.post(self.right, _TAG_LAST, module_tensors(self.last)))
        with torch.no_grad():
            for tensors, pending in incoming:
                message = self.channel.receive(pending)
                # copy_ bumps the version counters, so stacked weights restack: only where
                # the owner's values changed (its optimizer stepped), once per change.
                for mine, theirs in zip(tensors, message.tensors, strict=True):
                    if not torch.equal(mine, theirs):
                        mine.copy_(theirs)
                self.channel.release(message.tensors)
        for s in sent:
            self.channel.wait(s)
