"""``schedule="async"``: 1F1B without a flush, and what makes stale gradients usable.

:class:`AsyncHooks` is what the asynchronous stream adds to the one executor
(:mod:`mpx.pipeline.runtime.executor`): the stream's action lists (with their
``STEP`` actions), the weights each pass runs on, the gap-aware penalty and
the optimizer steps. It never runs a pass itself.

The stream of micro-batches never drains: stage ``s`` (``depth = p − 1 − s``
stages after it) runs a forward iff ``done_fwds − done_bwds <= depth`` and
steps its optimizer after every ``step_every`` backwards, so the gradient of
micro-batch ``j`` is computed on weights ``depth`` updates (steps, with
``step_every=1``) older than those it is applied to.

Which weights each pass uses::

                              forward of j          backward of j
    recompute=False           W_f                   W_f (its graph holds them)
    recompute=True            W_f (no grad)         W_f if weight_stashing, else current
    W_f = prediction of the weights at B(j) if weight_prediction, else current

``gap_aware`` damps each micro-batch's gradient by the gap between the
current weights and ``θ_used``: the weights the backward used (``"ga"``), or
the forward's (``"ga_jfl"``, which keeps a stash only for that). The step
always applies to the current weights. Gradients are taken with respect to
explicit leaf tensors (``torch.func.functional_call``), never the
parameters themselves, so optimizer updates between a forward and its
backward cannot touch a saved graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from mpx.pipeline.errors import PipelineError, PipelineValueError
from mpx.pipeline.model import Weights
from mpx.pipeline.runtime.executor import Hooks
from mpx.pipeline.runtime.passes import Micro, StagePasses, Stash
from mpx.pipeline.schedules import (
    Action,
    AsyncLayout,
    async_actions,
    async_flush_actions,
    rank_actions,
)
from mpx.pipeline.staleness import GAP_AWARE, PREDICTIONS, GapAware, future_lrs, predict

__all__ = ["AsyncHooks"]


class AsyncHooks(Hooks):
    """The asynchronous schedule's state on one stage (owned by a Pipeline).

    It gives the executor the stream's actions and its hooks, and gets the
    one thing it needs of its Pipeline as a callable: summing tied copies and
    averaging the gradients over data-parallel replicas before a step.

    Args:
        passes: the stage's passes (and neighbour traffic).
        chunks: micro-batches per call.
        checkpoint: the Pipeline's ``checkpoint`` (only ``"never"`` goes with async).
        average_grads: averages ``.grad`` over the replicas of this stage.
        weight_prediction, gap_aware, step_every, recompute, weight_stashing:
            the options of ``schedule="async"`` (see the module's docstring).

    Example::

        pipe = Pipeline(model, balance, chunks=4, schedule="async", weight_prediction="msnag")
        for x, y in batches:
            pipe.step(x, y, loss_fn, optimizer)
        pipe.flush(optimizer)
    """

    def __init__(
        self,
        passes: StagePasses,
        *,
        chunks: int,
        checkpoint: str,
        average_grads: Callable[[], None],
        weight_prediction: str | None,
        gap_aware: str | None,
        step_every: int,
        recompute: bool,
        weight_stashing: bool,
        split_backward: bool = False,
    ) -> None:
        if weight_prediction is not None and weight_prediction not in PREDICTIONS:
            raise PipelineValueError(
                f"weight_prediction={weight_prediction!r} is not one of "
                f"{', '.join(PREDICTIONS)} or None"
            )
        if gap_aware is not None and gap_aware not in GAP_AWARE:
            raise PipelineValueError(
                f"gap_aware={gap_aware!r} is not one of {', '.join(GAP_AWARE)} or None"
            )
        if gap_aware == "ga" and recompute and not weight_stashing:
            # The gap is |θ_now − θ_used| with θ_used the weights the backward
            # computed on (the asynchronous trainer's definition); recomputing
            # without a stash computes on the current weights, so Φ = 1 always
            # and "ga" would silently do nothing.
            raise PipelineValueError(
                "gap_aware='ga' has no effect with weight_stashing=False, recompute=True: "
                "the backward recomputes on the current weights, so the gap it measures "
                "is always 0; use gap_aware='ga_jfl' (the gap to the forward's weights) "
                "or weight_stashing=True"
            )
        if not isinstance(step_every, int) or step_every < 1:
            raise PipelineValueError(f"step_every={step_every!r} must be a positive int")
        if checkpoint != "never":
            raise PipelineValueError(
                f"checkpoint={checkpoint!r} is for the synchronous schedules; "
                "schedule='async' takes recompute=True|False"
            )
        self.passes, self.chunks = passes, chunks
        self._average_grads = average_grads
        self.scale = 1.0 / step_every
        # Each backward as I (its gradient upstream at once) then W: the
        # weights each pass uses do not change, only when the gradient leaves.
        self.split = split_backward
        # Chunks per rank: every virtual stage is a PipeDream stage of its own,
        # stepping its chunk's parameters (see schedule.AsyncLayout). With a
        # split backward or several chunks the stream is laid out by the
        # list scheduler (W deferred into the gaps), else by the one-stage rule.
        self.v = len(passes.stages)
        self.layout: AsyncLayout | None = None
        if self.v > 1 or split_backward:
            self.layout = AsyncLayout(passes.num_stages, self.v, split_backward)
        self.optimizer: torch.optim.Optimizer | None = None  # of the call under way
        self.scheduler: Any = None
        self.prediction, self.gap_aware = weight_prediction, gap_aware
        self.step_every, self.recompute, self.stashing = step_every, recompute, weight_stashing
        self.depth = passes.num_stages - 1 - passes.stage_id
        self.done_f = self.done_b = self.total = 0
        self.version = 0  # optimizer steps taken by this stage (all chunks)
        self.staleness: list[int] = []  # per backward: steps of its chunk since its forward
        self.params = [
            (i, name, p)
            for i, d in passes.stage.named_layer_params().items()
            for name, p in d.items()
        ]
        # Per virtual stage of this rank: its parameters, backwards done, steps.
        self.chunk_params = {
            s: [
                (i, name, p)
                for i, d in passes.stage.named_layer_params(k).items()
                for name, p in d.items()
            ]
            for k, s in enumerate(passes.stages)
        }
        self.chunk_b = dict.fromkeys(passes.stages, 0)
        self.chunk_version = dict.fromkeys(passes.stages, 0)
        self._ga: GapAware | None = None
        self._ga_optimizer: torch.optim.Optimizer | None = None
        # Gap-aware statistics loaded from a checkpoint, for the next optimizer seen.
        self._ga_loaded: dict[str, Any] | None = None

    # -- weights ---------------------------------------------------------------

    def _steps_before_backward(self, j: int, s: int) -> int:
        """Steps of chunk ``s`` between now and the backward of ``j`` (a chunk's
        backwards run in order, each after the last one's step)."""
        k = self.step_every
        return sum(1 for b in range(self.chunk_b[s], j) if (b + 1) % k == 0)

    def _forward_weights(
        self, j: int, s: int, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> dict[torch.nn.Parameter, torch.Tensor] | None:
        """Values for the forward of ``j`` on chunk ``s``; None: the live parameters will do."""
        d = self._steps_before_backward(j, s) if optimizer is not None else 0
        if d == 0:
            return None  # nothing changes before the backward
        plist = [p for _, _, p in self.chunk_params[s]]
        if self.prediction is not None:
            assert optimizer is not None
            lrs = future_lrs(optimizer, scheduler, d)
            return predict(optimizer, plist, d, self.prediction, lrs)
        if self.stashing or not self.recompute or self.gap_aware == "ga_jfl":
            return {p: p.detach().clone() for p in plist}
        return None

    def _leaves(self, values: dict[torch.nn.Parameter, torch.Tensor] | None, s: int) -> Weights:
        """Leaf tensors requiring grad, one per parameter of chunk ``s`` (no copy for live ones)."""
        out: Weights = {}
        for i, name, p in self.chunk_params[s]:
            t = p.detach() if values is None else values[p].detach()
            out.setdefault(i, {})[name] = t.requires_grad_(p.requires_grad)
        return out

    def _plain(
        self, values: dict[torch.nn.Parameter, torch.Tensor] | None, s: int
    ) -> Weights | None:
        if values is None:
            return None
        out: Weights = {}
        for i, name, p in self.chunk_params[s]:
            out.setdefault(i, {})[name] = values[p]
        return out

    # -- hooks (see mpx.pipeline.runtime.executor.Hooks) --------------------------------

    def before_forward(self, action: Action, mb: Micro) -> None:
        j, s = action.mb, action.stage
        mb.recompute = self.recompute
        values = self._forward_weights(j, s, self.optimizer, self.scheduler)
        mb.stash = Stash(values, self.chunk_version[s])
        if self.recompute:
            mb.weights = self._plain(values, s)
        else:
            # Live parameters (nothing steps before the backward) go straight
            # into the graph, and autograd accumulates into ``.grad`` itself.
            mb.weights = None if values is None else self._leaves(values, s)

    def before_backward(self, action: Action, mb: Micro) -> None:
        stash = self._stash(mb)
        values = stash.values
        if self.recompute:
            used = values if (self.stashing and values is not None) else None
        else:
            used = values
        gap_ref = values if self.gap_aware == "ga_jfl" else used
        # The gap-aware penalty needs this micro-batch's gradient on its own.
        separate = self._ga is not None and gap_ref is not None
        if self.recompute:
            leaves = self._leaves(used, mb.stage) if (used is not None or separate) else None
            mb.backward_weights = leaves
        else:
            leaves = mb.weights
        stash.grad_leaves = leaves
        stash.gap_ref = gap_ref if separate else None
        self.staleness.append(self.chunk_version[mb.stage] - stash.version)

    @staticmethod
    def _stash(mb: Micro) -> Stash:
        if mb.stash is None:
            raise PipelineError(f"internal: micro-batch on chunk {mb.stage} has no stash")
        return mb.stash

    def weights(self, mb: Micro) -> list[torch.Tensor]:
        leaves = None if mb.stash is None else mb.stash.grad_leaves
        part = self.passes.part[mb.stage]
        if leaves is None:
            return [
                p for d in self.passes.stage.named_layer_params(part).values() for p in d.values()
            ]
        return [
            leaves[i][n] for i, d in self.passes.stage.named_layer_params(part).items() for n in d
        ]

    def after_backward(self, action: Action, mb: Micro) -> None:
        stash = self._stash(mb)
        leaves, gap_ref = stash.grad_leaves, stash.gap_ref
        if leaves is not None:
            with torch.no_grad():
                for i, name, p in self.chunk_params[mb.stage]:
                    g = leaves[i][name].grad
                    if g is None:
                        continue
                    if gap_ref is not None:
                        assert self._ga is not None
                        g = g / self._ga.penalty(p, gap_ref[p])
                    if p.grad is None:
                        p.grad = g  # the leaf's own gradient: nobody else holds it
                    else:
                        p.grad.add_(g)
        self.done_b += 1
        self.chunk_b[mb.stage] += 1

    def step(self, action: Action) -> None:
        if self.optimizer is not None:
            self._step(self.optimizer, self.scheduler, action.stage)

    def _step(self, optimizer: torch.optim.Optimizer, scheduler: Any, s: int) -> None:
        """The step of chunk ``s`` (``-1``: of the rank's one chunk)."""
        s = self.passes.stages[0] if s < 0 else s
        mine = [p for _, _, p in self.chunk_params[s]]
        # With several chunks only chunk s steps: the others' gradients (owed
        # to their own steps) are set aside, so the optimizer skips them.
        others = [p for t, ps in self.chunk_params.items() if t != s for _, _, p in ps]
        aside = [p.grad for p in others]
        for p in others:
            p.grad = None
        ga = self._gap(optimizer)
        if ga is not None:
            ga.damp_weight_decay(optimizer)
        self._average_grads()
        for p in others:  # averaging gave them zeros: a step would move them
            p.grad = None
        before: dict[torch.Tensor, torch.Tensor] | None = None
        if ga is not None and ga.kind == "adam":
            before = {p: p.detach().clone() for p in mine}
        optimizer.step()
        if scheduler is not None and s == self.passes.stages[0]:
            scheduler.step()  # once per step of the rank's first chunk
        if ga is not None:
            ga.after_step(optimizer, before, set(mine))
        optimizer.zero_grad(set_to_none=True)
        for p, g in zip(others, aside, strict=True):
            p.grad = g
        self.version += 1
        self.chunk_version[s] += 1

    def _gap(self, optimizer: torch.optim.Optimizer) -> GapAware | None:
        if self.gap_aware is None:
            return None
        if self._ga is None or self._ga_optimizer is not optimizer:
            self._ga, self._ga_optimizer = GapAware(optimizer), optimizer
            if self._ga_loaded is not None:
                self._ga.load_state_dict(self._ga_loaded, self._param_list())
                self._ga_loaded = None
        return self._ga

    def _param_list(self) -> list[torch.Tensor]:
        return [p for _, _, p in self.params]

    # -- calls -----------------------------------------------------------------

    def begin(
        self, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> tuple[list[int], list[Action]]:
        """A call of ``chunks`` more micro-batches: their ids and this stage's actions."""
        self.optimizer, self.scheduler = optimizer, scheduler
        first_id = self.total
        self.total += self.chunks
        if optimizer is not None:
            self._gap(optimizer)
        passes = self.passes
        stage = passes.stages[0]
        every = self.step_every if optimizer is not None else 0
        if self.layout is not None:
            compute = self.layout.call(self.total, every)[passes.stage_id]
        else:
            compute = async_actions(
                self.depth, self.done_f, self.done_b, self.total, stage, every, self.split
            )
        self.done_f += sum(a.kind == "F" for a in compute)
        actions = rank_actions(
            "async", passes.stage_id, passes.num_stages, self.chunks, self.v, actions=compute
        )
        return list(range(first_id, first_id + self.chunks)), actions

    def flush_actions(
        self, optimizer: torch.optim.Optimizer | None, scheduler: Any
    ) -> list[Action]:
        """The backwards still owed (with their steps), and a last partial accumulation's step."""
        self.optimizer, self.scheduler = optimizer, scheduler
        stage = self.passes.stages[0]
        every = self.step_every if optimizer is not None else 0
        if self.layout is not None:
            compute = self.layout.call(self.total, every, flush=True)[self.passes.stage_id]
        else:
            compute = async_flush_actions(self.done_f, self.done_b, stage, every, self.split)
        return rank_actions(
            "async",
            self.passes.stage_id,
            self.passes.num_stages,
            self.chunks,
            self.v,
            actions=compute,
        )

    def in_flight(self) -> int:
        """Micro-batches whose backward is still owed (0 after :meth:`flush`)."""
        return self.done_f - self.done_b

    def state_dict(self) -> dict[str, Any]:
        """The stream's counters and gap-aware statistics, at a drained point.

        Drained (after :meth:`flush`) no micro-batch is live, so there are no
        stashed weights or activations to save; the weight predictor reads
        only the optimizer's state (saved with it) and the counters.
        """
        ga = self._ga.state_dict(self._param_list()) if self._ga is not None else self._ga_loaded
        return {
            "done_f": self.done_f,
            "done_b": self.done_b,
            "total": self.total,
            "version": self.version,
            "chunk_versions": [self.chunk_version[s] for s in self.passes.stages],
            "staleness": list(self.staleness),
            "gap_aware": ga,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict` into a runner of the same stage."""
        self.done_f, self.done_b = int(state["done_f"]), int(state["done_b"])
        self.total, self.version = int(state["total"]), int(state["version"])
        self.staleness = [int(s) for s in state["staleness"]]
        versions = state.get("chunk_versions", [self.version])
        self.chunk_version = dict(zip(self.passes.stages, map(int, versions), strict=True))
        # Saved drained: every chunk has run every micro-batch both ways.
        self.chunk_b = dict.fromkeys(self.passes.stages, self.total)
        if self.layout is not None:
            self.layout = AsyncLayout(self.passes.num_stages, self.v, self.split)
            self.layout.f = [self.total] * self.layout.n
            self.layout.b = [self.total] * self.layout.n
        self._ga, self._ga_optimizer, self._ga_loaded = None, None, state["gap_aware"]

    def reset(self) -> None:
        """Drops the stream after a failure: the micro-batches in flight are forgotten and
        numbering restarts at 0, as in a fresh pipeline (the weights keep their steps)."""
        self.done_f = self.done_b = self.total = 0
        self.chunk_b = dict.fromkeys(self.passes.stages, 0)
        if self.layout is not None:
            self.layout = AsyncLayout(self.passes.num_stages, self.v, self.split)
