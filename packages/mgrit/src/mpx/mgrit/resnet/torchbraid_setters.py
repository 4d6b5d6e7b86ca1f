"""torchbraid's setters on :class:`~mpx.mgrit.LayerParallel`: thin aliases of its settings.

A torchbraid script configures its ``LayerParallel`` with setters after building
it (``setCFactor(4)``, ``setFwdMaxIters(2)``, ...); mpx takes the same settings
as constructor keywords (:class:`~mpx.mgrit.MGRITOptions`). These aliases let such
a script run renamed, not rewritten: each replaces ``net.options`` with the one
setting changed and rebuilds the solver (collective: every rank calls them, as
torchbraid's scripts do). A setting that moves the steps between ranks (the
coarsening factor decides the split) gathers the layers and places them again,
weights kept. Call them before the first forward pass and before building the
optimizer (the parameters of re-placed layers are new tensors); after the first
forward they raise :class:`~mpx.mgrit.MGRITConfigError`.

mpx relaxes the forward and the adjoint solve alike, so ``setFwdNumRelax`` and
``setBwdNumRelax`` set one relaxation; giving them different values raises.

Example::

    net = LayerParallel(opening, lambda: StepLayer(c), closing, num_steps=64)
    net.setCFactor(4); net.setFwdMaxIters(2); net.setBwdMaxIters(1)
    net.setNumRelax(1); net.setFwdNumRelax(0, level=0); net.setBwdNumRelax(0, level=0)
    serial = net.buildSequentialOnRoot()   # rank 0: the sequential network; others: None
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mpx.collectives import Communicator
from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.solver import MGRITOptions, check_int, coarsening_factors

__all__ = ["TorchbraidSetters"]


class TorchbraidSetters:
    """The setters (mixed into :class:`~mpx.mgrit.LayerParallel`; see the module doc)."""

    options: MGRITOptions
    comm: Communicator
    #: torchbraid's print level: from 1, rank 0 prints each forward's residuals
    print_level: int = 0

    def _reconfigure(self, options: MGRITOptions) -> None:  # LayerParallel's
        raise NotImplementedError

    def serial(self) -> Any:  # LayerParallel's
        raise NotImplementedError

    def _set(self, **changes: Any) -> None:
        self._reconfigure(dataclasses.replace(self.options, **changes))

    def setCFactor(self, cfactor: int, level: int = -1) -> None:
        """The coarsening factor of every coarsening (``level=-1``) or of the one from
        ``level`` to ``level + 1`` (``cfactor=`` of :class:`~mpx.mgrit.MGRITOptions`)."""
        if level == -1:
            self._set(cfactor=cfactor)
            return
        opts = self.options
        deepest = max(opts.forward_levels, opts.adjoint_levels)
        factors = coarsening_factors(opts.cfactor, deepest)
        if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < len(factors):
            raise MGRITConfigError(
                f"setCFactor: level={level!r} is not a coarsening of this grid ({deepest} "
                f"levels: 0..{len(factors) - 1}), or -1 for all of them"
            )
        factors[level] = cfactor
        self._set(cfactor=tuple(factors))

    def setFwdMaxLevels(self, levels: int) -> None:
        """The forward solve's levels (``fwd_levels=``)."""
        self._set(fwd_levels=levels)

    def setBwdMaxLevels(self, levels: int) -> None:
        """The adjoint solve's levels (``bwd_levels=``)."""
        self._set(bwd_levels=levels)

    def setMaxLevels(self, levels: int) -> None:
        """Both solves' levels (``levels=``, the per-solve ones unset)."""
        self._set(levels=levels, fwd_levels=None, bwd_levels=None)

    def setFwdMaxIters(self, iters: int) -> None:
        """The forward solve's most cycles (``fwd_iters=``)."""
        self._set(fwd_iters=iters)

    def setBwdMaxIters(self, iters: int) -> None:
        """The adjoint solve's most cycles (``bwd_iters=``)."""
        self._set(bwd_iters=iters)

    def setFwdAbsTol(self, tol: float) -> None:
        """The forward solve's residual to stop at (``fwd_tol=``)."""
        self._set(fwd_tol=tol)

    def setBwdAbsTol(self, tol: float) -> None:
        """The adjoint solve's residual to stop at (``bwd_tol=``)."""
        self._set(bwd_tol=tol)

    def setSkipDowncycle(self, skip: bool) -> None:
        """Whether the first cycle builds its guess coarse to fine (``skip_downcycle=``)."""
        self._set(skip_downcycle=bool(skip))

    def setNumRelax(self, relax: int, level: int = -1) -> None:
        """CF sweeps after the first F sweep (0: F-relaxation), on every level (``-1``:
        ``relax``/``nrelax``) or on the fine level only (``0``: ``fine_relax``)."""
        self._relax("setNumRelax", relax, level)

    def setFwdNumRelax(self, relax: int, level: int = -1) -> None:
        """As :meth:`setNumRelax` (both solves relax alike in mpx)."""
        self._relax("setFwdNumRelax", relax, level, solve="forward")

    def setBwdNumRelax(self, relax: int, level: int = -1) -> None:
        """As :meth:`setNumRelax` (both solves relax alike in mpx)."""
        self._relax("setBwdNumRelax", relax, level, solve="adjoint")

    def _relax(self, name: str, relax: int, level: int, solve: str = "") -> None:
        check_int(relax, f"{name}: relax", 0, "CF sweeps after the first F sweep (0: F only)")
        if level not in (-1, 0):
            raise MGRITConfigError(
                f"{name}: level={level!r}; mpx relaxes every coarse level alike: give -1 (every "
                "level) or 0 (the fine level only, fine_relax)"
            )
        if solve:
            # The other solve's value, if a setter gave one: they must agree.
            given: dict[tuple[str, int], int] = self.__dict__.setdefault("_relax_given", {})
            other = "adjoint" if solve == "forward" else "forward"
            if given.get((other, level), relax) != relax:
                raise MGRITConfigError(
                    f"{name}({relax}, level={level}) differs from the {other} solve's "
                    f"({given[other, level]}); mpx relaxes the forward and the adjoint solve "
                    "alike: give both the same value"
                )
            given[solve, level] = relax
        kind = "FCF" if relax > 0 else "F"
        if level == -1:
            self._set(relax=kind, nrelax=max(relax, 1) if relax else self.options.nrelax)
        elif relax > 1 and relax != self.options.nrelax:
            raise MGRITConfigError(
                f"{name}({relax}, level=0): the fine level's CF sweeps are the coarse levels' "
                f"(nrelax={self.options.nrelax}); give 0 or 1 there, or set both with level=-1"
            )
        else:
            self._set(fine_relax=kind)

    def setPrintLevel(self, level: int, tb_print: bool = False) -> None:
        """From 1, rank 0 prints each forward pass's residual history and the last
        backward's (XBraid's levels have no other equivalent; ``tb_print`` is accepted)."""
        check_int(level, "setPrintLevel: level", 0, "0 prints nothing")
        self.print_level = level

    def buildSequentialOnRoot(self) -> Any:
        """The sequential network on rank 0 (None elsewhere). Collective: :meth:`serial`."""
        net = self.serial()
        return net if self.comm.rank == 0 else None
