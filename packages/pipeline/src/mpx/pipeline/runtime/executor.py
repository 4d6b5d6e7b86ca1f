"""One executor for every schedule: it runs a rank's list of actions.

::

    Pipeline.step ──> Executor.run(actions, hooks)
                        F       input (given, received, or handed over) -> forward
                        SEND_F  activation to the next chunk's rank
                        RECV_B  the output's gradient
                        B | I   full backward | input gradient (graph freed;
                                what W needs kept, see mpx.pipeline.split_backward.deferred)
                        W       weight gradient
                        SEND_B  input gradient to the previous chunk's rank
                        STEP    hooks.step(a) (the asynchronous stream's optimizer steps)

The schedule (:mod:`mpx.pipeline.schedules.table`) decides the order; what a
schedule adds to the passes is a :class:`Hooks` object: the synchronous
schedules' numbering, loss scale and checkpointing (:class:`SyncHooks`); the
asynchronous stream's weight stashing, prediction, gap-aware scaling and
recomputation (:class:`mpx.pipeline.runtime.stale.AsyncHooks`). Receives are posted
ahead (headers at the start of a call, gradients right after their
activation leaves), so ``RECV_F``/``RECV_B`` only wait for what is already
on its way.

Every action's start and end times go to :attr:`Executor.trace` (seconds of
``time.perf_counter``, one clock for all processes of a node): the measured
bubble of a call is ``1 − Σ busy / (ranks × span)`` over every rank's trace
(:func:`measured_bubble`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpx.pipeline.runtime.passes import LossFn, Micro, StagePasses
from mpx.pipeline.schedules import COMPUTE, Action

__all__ = ["Executor", "Hooks", "SyncHooks", "measured_bubble"]


class Hooks:
    """What a schedule adds to the passes; the defaults do nothing.

    Attributes:
        scale: each micro-batch's loss is multiplied by it before its backward.
    """

    scale = 1.0

    def number(self, j: int) -> int:
        """The micro-batch number of ``j`` for the dropout seeds (:func:`layer_seed`)."""
        return j

    def before_forward(self, action: Action, mb: Micro) -> None:
        """Sets ``mb.recompute`` and the weights the forward runs on (``mb.weights``)."""

    def before_backward(self, action: Action, mb: Micro) -> None:
        """Before ``B`` or ``I``: the weights a recomputation runs on."""

    def weights(self, mb: Micro) -> list[torch.Tensor]:
        """The tensors ``W`` differentiates (the weights the forward used) on a chunk
        whose backward keeps its graph for ``W`` (see
        :mod:`mpx.pipeline.split_backward.retained`)."""
        return []

    def after_backward(self, action: Action, mb: Micro) -> None:
        """After ``B``, or after ``W`` (the micro-batch's gradients are complete)."""

    def step(self, action: Action) -> None:
        """A ``STEP`` action (``action.stage``: the chunk that steps, -1 for the rank's one)."""


class SyncHooks(Hooks):
    """The synchronous schedules: numbering from ``base``, ``1/m`` loss scale, checkpointing.

    Args:
        passes: the rank's passes (for the chunks' parameters).
        base: the number of the call's first micro-batch (dropout seeds).
        chunks: micro-batches in the call.
        checkpoint: ``"never"``, ``"except_last"`` or ``"always"``.
    """

    def __init__(self, passes: StagePasses, base: int, chunks: int, checkpoint: str) -> None:
        self.passes, self.base, self.chunks, self.checkpoint = passes, base, chunks, checkpoint
        self.scale = 1.0 / chunks

    def number(self, j: int) -> int:
        return self.base + j

    def before_forward(self, action: Action, mb: Micro) -> None:
        mb.recompute = self.checkpoint == "always" or (
            self.checkpoint == "except_last" and action.mb < self.chunks - 1
        )

    def weights(self, mb: Micro) -> list[torch.Tensor]:
        part = self.passes.part[mb.stage]
        layers = self.passes.stage.named_layer_params(part).values()
        return [p for d in layers for p in d.values()]


class Executor:
    """Runs lists of actions through a rank's :class:`StagePasses`.

    Attributes:
        trace: ``(action, start, end)`` of every action of the last call.
        live: micro-batches between their forward and their last backward pass.
        clock: what :attr:`trace` is timed with: ``time.perf_counter`` (one clock for
            every process of a node). A profile may set ``time.process_time`` on the
            class for CPU seconds per action (``bench_conv1d.py --actions``);
            :func:`measured_bubble` then means nothing.

    Example::

        ex = Executor(passes)
        losses = ex.run(rank_actions("1f1b", rank, p, m), SyncHooks(passes, 0, m, "never"),
                        inputs, targets, loss_fn)
    """

    clock: Callable[[], float] = time.perf_counter

    def __init__(self, passes: StagePasses) -> None:
        self.passes = passes
        self.trace: list[tuple[Action, float, float]] = []
        self.live: dict[tuple[int, int], Micro] = {}
        # Where the last run raised: its list and the index of the action.
        self.stopped: tuple[list[Action], int] | None = None
        self._received: dict[tuple[int, int], Micro] = {}

    def reset(self) -> None:
        """Forgets the micro-batches in flight (after a failure)."""
        for mb in [*self.live.values(), *self._received.values()]:
            mb.records.clear()
        self.live.clear()
        self._received.clear()
        self.stopped = None

    def run(
        self,
        actions: Sequence[Action],
        hooks: Hooks,
        inputs: dict[int, Any],
        targets: dict[int, Any],
        loss_fn: LossFn | None,
    ) -> list[float]:
        """Runs ``actions`` in order.

        Args:
            inputs, targets: by micro-batch, on the ranks holding the first and
                the last virtual stage.

        Returns:
            The losses of the forwards of the last virtual stage, in order.

        Raises:
            Whatever a pass raised; :attr:`stopped` then says at which action.
        """
        passes = self.passes
        last = passes.virtual - 1
        losses: list[float] = []
        self.trace = []
        self.stopped = None
        clock = type(self).clock
        # A call that splits backwards has its forwards record what W needs, but
        # those whose backward in this call is a full B (DualPipeV's pairs): they
        # need no records. (A forward whose backward comes in a later call, the
        # asynchronous stream's, records; if that backward is full, B runs its W.)
        split = any(a.kind == "W" for a in actions)
        full = {(a.stage, a.mb) for a in actions if a.kind == "B"} if split else set()
        done = 0  # actions run: the index of the one that raises
        try:
            for a in actions:
                start = clock()
                key = (a.stage, a.mb)
                if a.kind == "RECV_F":
                    self._received[key] = passes.input(a.mb, None, a.stage)
                elif a.kind == "F":
                    mb = self._received.pop(key, None)
                    if mb is None:
                        mb = passes.input(a.mb, inputs.get(a.mb) if a.stage == 0 else None, a.stage)
                    mb.target = targets.get(a.mb) if a.stage == last else None
                    mb.capture = split and key not in full
                    hooks.before_forward(a, mb)
                    passes.forward(a.mb, mb, hooks.number(a.mb), loss_fn)
                    if mb.loss is not None:
                        losses.append(float(mb.loss.detach()))
                    self.live[key] = mb
                elif a.kind == "SEND_F":
                    passes.send_activation(a.mb, self.live[key])
                elif a.kind == "RECV_B":
                    passes.receive_grads(a.mb, self.live[key])
                elif a.kind == "B":
                    mb = self.live.pop(key)
                    hooks.before_backward(a, mb)
                    passes.backward(a.mb, mb, hooks.number(a.mb), loss_fn, hooks.scale)
                    hooks.after_backward(a, mb)
                    if mb.grads_out is not None:
                        self.live[key] = mb  # until its SEND_B
                elif a.kind == "I":
                    mb = self.live[key]
                    hooks.before_backward(a, mb)
                    # The weights only for a chunk that keeps its graph (a list built
                    # per call otherwise, for nothing).
                    weights = None if mb.capture else hooks.weights(mb)
                    passes.input_grad(a.mb, mb, hooks.number(a.mb), loss_fn, hooks.scale, weights)
                    mb.w_due = True
                elif a.kind == "W":
                    mb = self.live.pop(key)
                    mb.w_due = False
                    passes.weight_grad(a.mb, mb, None if mb.kept is None else hooks.weights(mb))
                    hooks.after_backward(a, mb)
                    if mb.grads_out is not None:
                        self.live[key] = mb
                elif a.kind == "SEND_B":
                    mb = self.live[key]
                    passes.send_input_grads(a.mb, mb)
                    if mb.out is None and not mb.w_due:
                        del self.live[key]  # backward done: nothing left to keep
                elif a.kind == "STEP":
                    hooks.step(a)
                else:
                    raise ValueError(f"internal: unknown action {a}")
                self.trace.append((a, start, clock()))
                done += 1
        except BaseException:
            self.stopped = (list(actions), done)
            raise
        return losses


def measured_bubble(traces: Sequence[Sequence[tuple[str, float, float]]]) -> float:
    """``1 − Σ busy / (ranks × span)`` over every rank's compute actions.

    Args:
        traces: per rank, ``(kind, start, end)`` of its actions (sends,
            receives and steps are not compute and are left out).
    """
    rows = [[(s, e) for k, s, e in row if k in COMPUTE] for row in traces]
    begin = min(s for row in rows for s, _ in row)
    end = max(e for row in rows for _, e in row)
    busy = sum(e - s for row in rows for s, e in row)
    return 1 - busy / (len(rows) * (end - begin))
