"""Layer-parallel residual networks: the N residual steps solved in time with MGRIT.

The network is ``open -> N steps x + h f_k(x) -> close`` with ``h = Tf / N``:
forward Euler for ``x' = f(t, x)``. The steps are time steps, so their layers
are split over ranks in blocks of time (see :mod:`mpx.mgrit.solver.grid`); the forward
pass is an MGRIT solve (``fwd_iters`` V-cycles, inexact on purpose), the
backward pass an MGRIT solve of the adjoint (``bwd_iters``)::

    every rank:  open(x) ──> x_0        rank r: x_a ─ f_a ─ ... ─ f_{b-1} ─> x_b
    every rank:  x_N (broadcast) ──> close ──> output and loss on every rank

Contract across ranks: every rank passes the same input batch and computes the
same loss. Then the output is the same on every rank, the open and close
layers (replicated) get the same gradients on every rank, and each step layer
lives on exactly one rank, which alone holds its gradient. A coarse level uses
the layer at its start point with the longer step ``h * stride``.

Running statistics (BatchNorm, InstanceNorm with ``track_running_stats``) in
step layers: MGRIT calls a step many times per forward pass (every relaxation,
every level, each with its own step size, and again in the adjoint), so a
BatchNorm left alone would fold all those calls into its running mean and
variance. In training, the calls of the solves normalize with the batch's
statistics and leave the running ones alone; once the forward solve is done,
each step layer runs once more on its solved state ``x_k``, which updates its
running statistics once per forward pass, from the states the serial network
would give it (to the solve's tolerance). Eval mode then normalizes with them.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Unpack

import torch
from torch import nn

from mpx.mgrit._comm import CommLike, as_communicator
from mpx.mgrit.adjoint import LayerHalo, StackedSteps, TimeStepper
from mpx.mgrit.errors import MGRITConfigError, MGRITTypeError
from mpx.mgrit.resnet.torchbraid_setters import TorchbraidSetters
from mpx.mgrit.solver import MGRITOptions, MGRITSettings, resolve

__all__ = ["LayerParallel", "SerialResNet"]


def _step_layers(
    step_layers: nn.Module | Sequence[nn.Module] | Callable[[], nn.Module],
    num_steps: int,
    owned: Sequence[int],
) -> list[nn.Module]:
    """The ``owned`` step layers: a module copied, picked from a list, or made by a factory."""
    if isinstance(step_layers, nn.Module):
        return [copy.deepcopy(step_layers) for _ in owned]
    if callable(step_layers):
        # Every rank calls the factory for every step, in order, and keeps its own: the
        # random initialisation then gives the same layers for any number of ranks.
        layers = [step_layers() for _ in range(num_steps)]
        wrong = next((layer for layer in layers if not isinstance(layer, nn.Module)), None)
        if wrong is not None:
            raise MGRITTypeError(
                f"the step_layers factory must return an nn.Module, it returned "
                f"{type(wrong).__name__}; write it as lambda: StepLayer(...)"
            )
        return [layers[k] for k in owned]
    if not isinstance(step_layers, Sequence):
        raise MGRITTypeError(
            f"step_layers must be an nn.Module, a list of num_steps modules or a factory "
            f"(lambda: StepLayer(...)), got {type(step_layers).__name__}"
        )
    layers = list(step_layers)
    if len(layers) != num_steps:
        raise MGRITConfigError(
            f"step_layers has {len(layers)} modules but num_steps={num_steps}; "
            "give one module per step, a single module to copy, or a factory"
        )
    return [layers[k] for k in owned]


#: The buffers of a module that keeps running statistics (BatchNorm, InstanceNorm).
_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


def _with_statistics(layer: nn.Module) -> list[nn.Module]:
    """The modules of ``layer`` that update running statistics in training (BatchNorm,
    InstanceNorm with ``track_running_stats=True``): a MGRIT solve must not update them."""
    return [
        m
        for m in layer.modules()
        if getattr(m, "track_running_stats", False)
        and isinstance(getattr(m, "running_mean", None), torch.Tensor)
    ]


@contextlib.contextmanager
def _statistics_held(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Inside, the training ``modules`` normalize with the batch's statistics and update
    no running ones (their buffers are set aside: torch's norms then neither read nor
    write them); eval ones are untouched (they normalize with the running statistics)."""
    held: list[tuple[nn.Module, str, torch.Tensor]] = []
    for m in modules:
        if m.training:
            own = dict(m.named_buffers(recurse=False))
            held.extend((m, name, own[name]) for name in _STATISTICS if own.get(name) is not None)
    for m, name, _ in held:
        setattr(m, name, None)
    try:
        yield
    finally:
        for m, name, buffer in held:
            setattr(m, name, buffer)


class SerialResNet(nn.Module):
    """The sequential network a :class:`LayerParallel` stands for.

    Example::

        net = SerialResNet(nn.Flatten(), [nn.Linear(8, 8) for _ in range(4)], nn.Linear(8, 2), 1.0)
        y = net(torch.randn(5, 8))
        assert len(net.steps) == 4
    """

    def __init__(
        self, open_layer: nn.Module, steps: Sequence[nn.Module], close_layer: nn.Module, Tf: float
    ) -> None:
        super().__init__()
        self.open_layer = open_layer
        self.steps = nn.ModuleList(steps)
        self.close_layer = close_layer
        self.h = float(Tf) / len(steps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.open_layer(x)
        for f in self.steps:
            x = x + self.h * f(x)
        out: torch.Tensor = self.close_layer(x)
        return out


class LayerParallel(TorchbraidSetters, nn.Module):
    """``open -> num_steps residual steps x + h f_k(x) -> close``, steps split over ranks.

    Args:
        open_layer: the first layer (replicated on every rank).
        step_layers: one module (copied for every step: each step has its own
            weights), a list of ``num_steps`` modules, or a factory called once per
            step (``lambda: StepLayer(c)``, as torchbraid's ``LayerParallel`` takes);
            a rank keeps only its own.
        close_layer: the last layer (replicated).
        num_steps: N, the number of residual steps.
        Tf: final time; the step size is ``h = Tf / num_steps``.
        comm: the ranks that share the layers (default: all); an mpx Communicator or an
            mpi4py one (``MPI.COMM_WORLD``, as torchbraid takes it).
        options: the MGRIT settings (:class:`~mpx.mgrit.MGRITOptions`: ``levels``,
            ``cfactor``, ``fwd_iters``, ``bwd_iters``, ``tol``, ``relax``, ...), or
        **settings: the same as keywords (``levels=3, fwd_iters=4``), not both; unset ones
            are :attr:`defaults`' (``fwd_iters=2, bwd_iters=1, relax="F"``...).
        batched: run the steps of all C-intervals of a rank as one batched product
            when every step layer is ``Linear(w, w)`` or ``Sequential(Linear(w, w), act)``
            with one elementwise activation (see :mod:`mpx.mgrit.adjoint.stacked`); the
            adjoint then linearises each step once. False: one module call per step.

    Example::

        net = LayerParallel(nn.Flatten(), nn.Sequential(nn.Linear(64, 64), nn.Tanh()),
                            nn.Linear(64, 10), num_steps=8, Tf=1.0, levels=2, fwd_iters=2)
        loss = nn.functional.cross_entropy(net(x), y); loss.backward()
        net.close()    # collective, when done: frees the adjoint's communicator

    The communicator the adjoint solve splits off ``comm`` is this network's own:
    :meth:`close` frees it (every rank calls it; MPI allows ~2000 communicators).
    """

    #: the settings a LayerParallel made without ``options=`` starts from
    defaults = MGRITOptions()

    def __init__(
        self,
        open_layer: nn.Module,
        step_layers: nn.Module | Sequence[nn.Module] | Callable[[], nn.Module],
        close_layer: nn.Module,
        num_steps: int,
        Tf: float = 1.0,
        comm: CommLike = None,
        *,
        options: MGRITOptions | None = None,
        batched: bool = True,
        **settings: Unpack[MGRITSettings],
    ) -> None:
        super().__init__()
        if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
            raise MGRITConfigError(f"num_steps must be an int >= 1, got {num_steps!r}")
        #: the MGRIT settings of the forward and the adjoint solve
        self.options = resolve("LayerParallel", options, settings, self.defaults)
        self.comm = as_communicator(comm)
        self.num_steps, self.Tf = num_steps, float(Tf)
        # The fine grid split over the ranks: every rank works at any depth. A rank's
        # boundary steps use its neighbours' boundary layers (mpx.mgrit.adjoint.halo).
        self.stepper = TimeStepper(
            self._phi, self._uses, num_steps, Tf, comm=self.comm, options=self.options,
            fine_split=True,
        )  # fmt: skip
        self.open_layer = open_layer
        self.close_layer = close_layer
        self._batched = batched
        # The torchbraid setters rebuild the solver: only before the first forward pass.
        self._forwarded = False
        try:
            self._place(step_layers, batched)
        except MGRITConfigError:
            # Bad step layers are bad on every rank (each rank sees the same): all free.
            self.stepper.close()
            raise

    @property
    def config(self) -> dict[str, Any]:
        """The MGRIT settings by name (a copy of :attr:`options`; change them with
        ``dataclasses.replace(net.options, ...)`` in a new network)."""
        return self.options.as_dict()

    def _place(
        self,
        step_layers: nn.Module | Sequence[nn.Module] | Callable[[], nn.Module] | None,
        batched: bool,
        chosen: dict[int, nn.Module] | None = None,
    ) -> None:
        """Keeps this rank's step layers (and, if they stack, runs them batched); ``chosen``:
        the layers by step, instead of ``step_layers`` (the ones kept by _reconfigure)."""
        num_steps = self.num_steps
        owned = self.stepper.owned_steps()
        self.first_step = owned.start
        fine = self.stepper.fwd.layout.levels[0]
        # The neighbours' boundary layers: step first - 1 (adjoint) and stop (forward).
        halo_steps = [k for k, peer in ((owned.start - 1, fine.left), (owned.stop, fine.right))
                      if peer is not None and len(owned) > 0]  # fmt: skip
        wanted = [*owned, *halo_steps]
        if chosen is not None:
            picked = [chosen[k] for k in wanted]
        else:
            assert step_layers is not None
            picked = _step_layers(step_layers, num_steps, wanted)
        self.local_steps = nn.ModuleList(picked[: len(owned)])
        # Copies, not parameters of this network (see mpx.mgrit.adjoint.halo): a plain dict.
        self._halo_layers = {
            k: copy.deepcopy(m) for k, m in zip(halo_steps, picked[len(owned) :], strict=True)
        }
        self._halo_statistics = {k: _with_statistics(m) for k, m in self._halo_layers.items()}
        before = self._halo_layers.get(owned.start - 1)
        after = self._halo_layers.get(owned.stop)
        if self._halo_layers:
            self.stepper.use_halo(
                LayerHalo(self.comm, fine.left, fine.right, picked[0], picked[len(owned) - 1],
                          before, after)
            )  # fmt: skip
        self._param_index: list[list[int]] = []
        self._params: list[nn.Parameter] = []
        # Per local step: its modules with running statistics (see the module doc).
        self._statistics = [_with_statistics(layer) for layer in self.local_steps]
        for layer in self.local_steps:
            start = len(self._params)
            self._params.extend(p for p in layer.parameters() if p.requires_grad)
            self._param_index.append(list(range(start, len(self._params))))
        # Layers of one stackable structure run batched over the C-intervals.
        stacked = StackedSteps.of(list(self.local_steps), before, after) if batched else None
        if stacked is not None:
            self.stepper.use_stacked(stacked)

    def owned_steps(self) -> range:
        """The global indices of the steps whose layers live on this rank."""
        return self.stepper.owned_steps()

    def _reconfigure(self, options: MGRITOptions) -> None:
        """The solver rebuilt with ``options`` (torchbraid's setters). Collective; where the
        split changes, the layers are gathered and placed again (weights kept)."""
        if options == self.options:
            return
        self._check_open()
        if self._forwarded:
            raise MGRITConfigError(
                "torchbraid's setters rebuild the solver and may move layers between ranks: "
                "call them before the first forward pass (and before building the optimizer), "
                "or give the settings when building the network (options= or keywords)"
            )
        stepper = TimeStepper(
            self._phi, self._uses, self.num_steps, self.Tf, comm=self.comm, options=options,
            fine_split=True,
        )  # fmt: skip
        if stepper.fwd.layout.blocks == self.stepper.fwd.layout.blocks:
            chosen = dict(zip(self.owned_steps(), self.local_steps, strict=True))
            chosen.update(self._halo_layers)
        else:  # the same blocks on every rank or on none: every rank gathers
            like = next(self.parameters(), None)
            chosen = {
                k: layer if like is None else layer.to(like.device)
                for k, layer in enumerate(self.gather_steps())
            }
        self.stepper.close()
        self.stepper, self.options = stepper, options
        self._place(None, self._batched, chosen)

    def _phi(self, k: int, x: torch.Tensor, dt: float) -> torch.Tensor:
        i = k - self.first_step
        if 0 <= i < len(self.local_steps):
            layer: nn.Module = self.local_steps[i]
            statistics = self._statistics[i]
        else:  # a neighbour's boundary layer (the fine split's boundary steps)
            layer, statistics = self._halo_layers[k], self._halo_statistics[k]
        if not statistics:
            out: torch.Tensor = x + dt * layer(x)
            return out
        with _statistics_held(statistics):
            out = x + dt * layer(x)
        return out

    def _update_statistics(self, states: torch.Tensor) -> None:
        """Runs each local step layer with running statistics once, on its solved state
        ``x_k`` (row ``k - first`` of ``states``): their one update of this forward pass."""
        with torch.no_grad():
            for i, (layer, statistics) in enumerate(
                zip(self.local_steps, self._statistics, strict=True)
            ):
                if any(m.training for m in statistics):
                    layer(states[i])

    def train(self, mode: bool = True) -> LayerParallel:
        """As ``nn.Module.train``; the neighbours' boundary layers (not submodules) follow."""
        super().train(mode)
        for layer in self._halo_layers.values():
            layer.train(mode)
        return self

    def _uses(self, k: int) -> list[int]:
        return self._param_index[k - self.first_step]

    def close(self) -> None:
        """Frees the communicator this network's adjoint solve split off. Collective.

        Every rank calls it, when done with the network (MPI frees communicators
        collectively: never left to the garbage collector); a second call does
        nothing. ``comm`` itself is the caller's and stays. Afterwards the forward
        pass, :meth:`gather_steps` and :meth:`serial` raise
        :class:`~mpx.mgrit.MGRITConfigError`; the layers and ``state_dict()`` stay.
        """
        self.stepper.close()

    def _check_open(self) -> None:
        self.stepper.check_open("this LayerParallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_open()
        x0 = self.open_layer(x)
        if any(m.training for statistics in self._statistics for m in statistics):
            # Running statistics: updated once, from the solved states (see the module doc).
            xN: torch.Tensor = _SolveUpdatingStatistics.apply(  # type: ignore[no-untyped-call]
                self, x0, *self._params
            )
        else:
            xN = self.stepper.apply(x0, self._params)
        self._forwarded = True
        if self.print_level >= 1 and self.comm.rank == 0:
            # torchbraid's setPrintLevel: this forward's solve, and the last backward's.
            fwd, bwd = self.fwd_stats()["residuals"], self.bwd_stats()["residuals"]
            print(f"LayerParallel: forward residuals {[f'{r:.2e}' for r in fwd]}; last "
                  f"backward {[f'{r:.2e}' for r in bwd]}", flush=True)  # fmt: skip
        out: torch.Tensor = self.close_layer(xN)
        return out

    def _work_steppers(self) -> list[TimeStepper]:
        """The solver whose work :func:`mpx.mgrit.work` reports."""
        return [self.stepper]

    def fwd_stats(self) -> dict[str, Any]:
        """Iterations and residual history of the last forward solve."""
        return {"iterations": self.stepper.fwd.iterations, "residuals": self.stepper.fwd.residuals}

    def bwd_stats(self) -> dict[str, Any]:
        """Iterations and residual history of the last adjoint solve."""
        return {"iterations": self.stepper.bwd.iterations, "residuals": self.stepper.bwd.residuals}

    def gather_steps(self) -> list[nn.Module]:
        """All ``num_steps`` step layers on every rank (copies; collective)."""
        self._check_open()
        local = [copy.deepcopy(layer).cpu() for layer in self.local_steps]
        if self.comm.size == 1:
            return local
        parts = self.comm.allgather_object(local)
        return [layer for part in parts for layer in part]

    def serial(self) -> SerialResNet:
        """The equivalent sequential network, with copies of all layers, on every rank."""
        device = next(self.parameters()).device if any(True for _ in self.parameters()) else None
        net = SerialResNet(
            copy.deepcopy(self.open_layer), self.gather_steps(), copy.deepcopy(self.close_layer),
            self.Tf,
        )  # fmt: skip
        return net if device is None else net.to(device)


class _SolveUpdatingStatistics(torch.autograd.Function):
    """``TimeStepper.apply`` that also hands the solved states to
    :meth:`LayerParallel._update_statistics` (the one place they exist: the forward
    solve keeps them for the adjoint only)."""

    @staticmethod
    def forward(ctx: Any, net: LayerParallel, x0: torch.Tensor, *tensors: torch.Tensor) -> Any:
        ctx.stepper, ctx.tensors = net.stepper, tensors
        xN, ctx.states, ctx.lease = net.stepper.forward(x0)
        net._update_statistics(ctx.states)
        return xN

    @staticmethod
    def backward(ctx: Any, gN: torch.Tensor) -> Any:
        lam0, grads = ctx.stepper.backward(gN, ctx.tensors, ctx.states)
        return (None, lam0, *grads)
