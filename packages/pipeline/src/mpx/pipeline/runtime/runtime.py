"""The engine under a :class:`~mpx.pipeline.Pipeline`: calls run, fail together, and are timed.

A :class:`Pipeline` is the ``nn.Module`` users hold: the model cut into
stages, its tied weights and replicas, the public calls. What runs a call is
a :class:`Runtime`: the one executor over the schedule's lists
(:mod:`mpx.pipeline.runtime.executor`), the asynchronous stream's hooks
(:mod:`mpx.pipeline.runtime.stale`), the failure agreement that makes every stage
raise the same error and undoes the call (:mod:`mpx.pipeline.runtime.failure`), and
the measurement of the passes' times the zero-bubble lists are laid out by.
When a call fails, the error carries a note: the rank-by-step grid of the
call near the action where this rank stopped (:func:`mpx.pipeline.schedules.timing.stopped_grid`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mpx.collectives import Communicator, allreduce
from mpx.pipeline.errors import PipelineError, PipelineValueError
from mpx.pipeline.model import Stage, concat
from mpx.pipeline.runtime.executor import Executor, Hooks, SyncHooks
from mpx.pipeline.runtime.failure import FailureAgreement, Status
from mpx.pipeline.runtime.inputs import eval_parts, split
from mpx.pipeline.runtime.passes import LossFn, Micro, StagePasses
from mpx.pipeline.runtime.replicas import ReplicaGradients
from mpx.pipeline.runtime.stale import AsyncHooks
from mpx.pipeline.schedules import (
    COMPUTE,
    TABLE,
    Action,
    PassCosts,
    Schedule,
    compute_actions,
    local_stages,
    rank_actions,
    rank_of,
    stopped_grid,
)

__all__ = ["MEASURE_AT", "MEASURE_CALLS", "AsyncOptions", "Runtime"]

MEASURE_AT = 2
"""``pass_costs="measured"``: the first training call whose trace the passes' times come
from (the first pays one-time costs: allocations, lazy initialisation)."""
MEASURE_CALLS = 5
"""``pass_costs="measured"``: the calls from :data:`MEASURE_AT` on that are timed; after
each the lists are laid out again by every pass's median over the calls timed so far.
One call's times alone set a layout for good: on a shared 2-core machine a
disturbed call gave a layout up to 6 % longer at the passes' true times (a
simulation with 10 % noise per pass), and the ZB-H1 layout's gain over 1F1B
read 1.00-1.08x between runs."""


@dataclass(frozen=True)
class AsyncOptions:
    """The options of ``schedule="async"`` (see :mod:`mpx.pipeline.runtime.stale`), as one object.

    The defaults are what a synchronous schedule must leave them at;
    ``Pipeline`` takes them as keyword arguments and builds this.
    """

    weight_stashing: bool = True
    weight_prediction: str | None = None
    gap_aware: str | None = None
    step_every: int = 1
    recompute: bool = False
    split_backward: bool = False

    def as_dict(self) -> dict[str, Any]:
        """The options by name (what the ranks compare, :mod:`mpx.pipeline.build_agreement`)."""
        return asdict(self)


class _UndoPoint:
    """What a failed call puts back: gradients, BatchNorm statistics, numbering.

    The gradients already in ``.grad`` are set aside (not copied) for the call,
    which accumulates into empty ones; :meth:`keep` adds the two, :meth:`undo`
    puts the old ones back. ``async`` learns that a call succeeded on every
    stage only in the next call, so it may undo the last call too: its
    :meth:`keep` leaves the set-aside gradients intact (a new sum).
    """

    def __init__(self, runtime: Runtime, set_aside_grads: bool) -> None:
        self.runtime = runtime
        self.counters = (runtime.microbatches, runtime.eval_calls)
        self.statistics = runtime.stage.save_statistics()
        self.params = list(runtime.parameters()) if set_aside_grads else []
        self.grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def keep(self, in_place: bool = True) -> None:
        """The call succeeded here: its gradients add to those set aside."""
        for p, old in zip(self.params, self.grads, strict=True):
            if old is None:
                continue
            if p.grad is None:
                p.grad = old if in_place else old.clone()
            elif in_place:
                p.grad = old.add_(p.grad)
            else:
                p.grad = old + p.grad

    def undo(self, optimizer: torch.optim.Optimizer | None) -> None:
        for p, old in zip(self.params, self.grads, strict=True):
            p.grad = old
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        self.runtime.stage.restore_statistics(self.statistics)
        self.runtime.microbatches, self.runtime.eval_calls = self.counters


class _EvalHooks(Hooks):
    """``pipe(x)``: forward only, dropout numbered apart from training (negative numbers)."""

    def __init__(self, base: int) -> None:
        self.base = base

    def number(self, j: int) -> int:
        return self.base - j

    def before_forward(self, action: Action, mb: Micro) -> None:
        mb.forward_only = True


class Runtime:
    """Runs one Pipeline's calls on this rank (see the module docstring).

    It gets what it drives explicitly, never the Pipeline itself: the stage
    and its passes, the parameters (for undoing a call), the replicas, and
    ``sum_tied`` (summing the gradients of tied copies before a step).

    Args:
        comm: the pipeline's private communicator.
        spec: the schedule's entry of :data:`mpx.pipeline.schedules.TABLE`.
        chunks, checkpoint, v: micro-batches per call, checkpointing, chunks per rank.
        pass_costs: ``"measured"``, ``"unit"`` or a mapping (see ``Pipeline``).
        options: the async-only options.
        tied_across_ranks: the model ties a weight across ranks.

    Raises:
        PipelineValueError: ``pass_costs`` or async options that cannot run, or a
            schedule that cannot run these sizes; alike on every rank.
    """

    def __init__(
        self,
        comm: Communicator,
        stage: Stage,
        passes: StagePasses,
        spec: Schedule,
        *,
        chunks: int,
        checkpoint: str,
        v: int,
        pass_costs: PassCosts | str,
        options: AsyncOptions,
        tied_across_ranks: bool,
        parameters: Callable[[], Iterator[nn.Parameter]],
        replicas: ReplicaGradients,
        sum_tied: Callable[[], None],
    ) -> None:
        self.comm, self.stage, self.passes, self.spec = comm, stage, passes, spec
        self.chunks, self.checkpoint, self.v = chunks, checkpoint, v
        self.parameters, self.replicas, self.sum_tied = parameters, replicas, sum_tied
        self.ranks, self.rank = comm.size, comm.rank
        self.executor = Executor(passes)
        if isinstance(pass_costs, str) and pass_costs not in ("measured", "unit"):
            raise PipelineValueError(
                f"pass_costs={pass_costs!r} is not 'measured', 'unit' or a mapping of "
                "'F', 'I' and 'W' to one time per virtual stage"
            )
        self.costs = None if isinstance(pass_costs, str) else pass_costs
        self.measure = pass_costs == "measured" and spec.timed
        self.training_calls = 0  # successful synchronous ones (pass_costs="measured")
        self.timings: list[torch.Tensor] = []  # the passes' times of each call timed
        # A schedule that cannot run these sizes (or bad costs) says so now, alike on every
        # rank. The list is kept: laying out a zero-bubble one takes milliseconds (68 at
        # 4 ranks and 16 micro-batches), every call would pay them.
        self.actions = self.lay_out()
        if passes.boxes:
            stage.progress = self.progress
        self.microbatches = 0  # numbers the training micro-batches (dropout seeds)
        self.ids: list[int] = []  # the micro-batch ids of the call under way
        self.eval_calls = 0
        self.stale: AsyncHooks | None = None
        self.pending_status: Status | None = None  # async: read by the next call
        self.deferred: PipelineError | None = None  # raised by the next call (failure.py)
        self.last_call_undo: _UndoPoint | None = None  # async: undoes the last call too
        self._drawn = ("step", chunks)  # the call a failure's grid shows, its micro-batches
        if spec.stream and v > 1 and tied_across_ranks:
            # Each chunk steps alone (its own PipeDream stage): copies of a tied
            # weight on different ranks' chunks would step at different times.
            raise PipelineValueError(
                f"schedule='async' with stages_per_rank={v} steps each chunk on its own, "
                "so the copies of a weight tied across ranks would diverge; pass "
                "stages_per_rank=1 (or a synchronous schedule) for a model with tied weights"
            )
        if spec.stream:
            self.stale = AsyncHooks(
                passes,
                chunks=chunks,
                checkpoint=checkpoint,
                average_grads=self.step_grads,
                **options.as_dict(),
            )
        elif options != AsyncOptions():
            stream = next(s.name for s in TABLE if s.stream)
            *most, last = (s.name for s in TABLE if s.split)
            raise PipelineValueError(
                "weight_stashing, weight_prediction, gap_aware, step_every, recompute and "
                f"split_backward are options of schedule={stream!r}, not of "
                f"schedule={spec.name!r} (the synchronous schedules that split the backward "
                f"are {', '.join(most)} and {last})"
            )
        # Every call ends with a status collective; a stage that fails tells
        # the others at once (mpx.pipeline.runtime.failure). Last: it posts receives,
        # which an argument error above would leave behind in the communicator.
        self.agreement = FailureAgreement(comm, passes)
        self.agreement.loss_rank = rank_of(self.ranks * v - 1, self.ranks, spec.placement)
        passes.set_interrupt(self.agreement.interrupt)

    # -- calls --------------------------------------------------------------------

    def step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
    ) -> float:
        """``Pipeline.step``: one mini-batch, and the optimizer's step if given."""
        self.begin_call("checking the arguments")
        if self.stale is not None:
            return self._async_step(inputs, target, loss_fn, optimizer, scheduler)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        undo = _UndoPoint(self, set_aside_grads=True)
        status_due = True
        try:
            xs = split(inputs, "inputs", self.passes.first, self.chunks, self.rank)
            ts = split(target, "target", self.passes.last, self.chunks, self.rank)
            loss = self._sync_call(xs, ts, loss_fn)
            status = self.agreement.issue(loss, ok=True)
            status_due = False
            loss = self.agreement.read(status)
        except Exception as error:
            return self.fail(error, "step", undo, optimizer, status_due)
        # This call's gradients only (the earlier ones, set aside, were summed).
        self.sum_tied()
        undo.keep()
        self.training_calls += 1
        if self.measure and 0 <= self.training_calls - MEASURE_AT < MEASURE_CALLS:
            self.costs = self.measured_costs()
            self.actions = self.lay_out()
        self.replicas.average()
        if optimizer is not None:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        return self.replicas.average_loss(loss)

    def _async_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
    ) -> float:
        assert self.stale is not None
        # With an optimizer the call steps (and zeroes) the gradients itself:
        # a failure drops the ones accumulated toward the next step.
        undo = _UndoPoint(self, set_aside_grads=optimizer is None)
        status_due = True
        try:
            xs = split(inputs, "inputs", self.passes.first, self.chunks, self.rank)
            ts = split(target, "target", self.passes.last, self.chunks, self.rank)
            self.ids, actions = self.stale.begin(optimizer, scheduler)
            self.passes.start_call(self.ids)
            losses = self.run(actions, self.stale, xs, ts, loss_fn)
            # The last sends stay in flight into the next call (the Outboxes hold
            # their tensors): waiting here would stall this stage until its
            # neighbour, busy computing, polls for them. ``flush`` waits for them.
            self.progress()
            loss = sum(losses) / len(losses) if losses else 0.0
            # Reading this call's status at once would make every call wait
            # for the last stage, a flush in all but name: the next call reads it.
            previous, self.pending_status = self.pending_status, None
            self.pending_status = self.agreement.issue(loss, ok=True)
            status_due = False
            shared = self.read_status(previous)
        except Exception as error:
            return self.fail(error, "step", undo, optimizer, status_due)
        undo.keep(in_place=False)
        self.last_call_undo = undo
        return shared

    def forward(self, inputs: Any) -> Any:
        """``Pipeline.forward``: forward only; the output on the last stage, None elsewhere."""
        self.begin_call("checking the arguments")
        undo = _UndoPoint(self, set_aside_grads=False)
        status_due = True
        try:
            out = self._forward_call(inputs)
            status = self.agreement.issue(0.0, ok=True)
            status_due = False
            self.agreement.read(status)
        except Exception as error:
            self.fail(error, "forward", undo, None, status_due)
            return None  # (not reached: forward reads its status in the call)
        if self.stale is not None:
            self.last_call_undo = undo
        return out

    def _forward_call(self, inputs: Any) -> Any:
        passes = self.passes
        # ``async`` leaves its last sends in flight; their slots are reused here.
        passes.finish_sends()
        m = eval_parts(inputs, passes.first, self.chunks, self.comm)
        if not m:
            return None  # rank 0's inputs were bad: it raises, the status tells everyone
        xs = split(inputs, "inputs", passes.first, self.chunks, self.rank, parts=m)
        self.ids = list(range(m))
        passes.start_call(self.ids)
        self.eval_calls += 1
        compute = [Action("F", j, s) for j in range(m) for s in passes.stages]
        actions = rank_actions(self.spec.name, self.rank, self.ranks, m, self.v, actions=compute)
        # ``async`` keeps its stream's micro-batches live between calls: this
        # call's own go elsewhere.
        ex = self.executor
        kept, ex.live = ex.live, {}
        self._drawn = ("forward", m)
        try:
            with torch.no_grad():
                # Numbered by ``chunks`` (>= m): calls of fewer micro-batches never share a seed.
                self.run(actions, _EvalHooks(-self.eval_calls * self.chunks), xs, [], None)
            passes.finish_sends()
            outs = []
            last = passes.virtual - 1
            for (s, _), mb in sorted(ex.live.items(), key=lambda kv: kv[0][1]):
                if s == last:
                    outs.append(mb.out)
                passes.release_input(mb)
        finally:
            ex.live = kept
        return concat(outs) if passes.last else None

    def flush(self, optimizer: torch.optim.Optimizer | None, scheduler: Any) -> float:
        """``Pipeline.flush``: the stream's backwards still owed (``async`` only)."""
        assert self.stale is not None
        self.begin_call("flushing")
        undo = _UndoPoint(self, set_aside_grads=optimizer is None)
        try:
            actions = self.stale.flush_actions(optimizer, scheduler)
            self.ids = []
            self.run(actions, self.stale, [], [], None)
            self.passes.finish_sends()
            previous, self.pending_status = self.pending_status, None
            loss = self.read_status(previous)
        except Exception as error:
            return self.fail(error, "flush", undo, optimizer, status_due=False)
        undo.keep(in_place=False)
        self.last_call_undo = undo
        return loss

    def run(
        self, actions: list[Action], hooks: Hooks, xs: list[Any], ts: list[Any], loss_fn: Any
    ) -> list[float]:
        """Runs this rank's actions of a call: the one executor, for every schedule."""
        inputs = {j: x for j, x in zip(self.ids, xs, strict=False)}
        targets = {j: t for j, t in zip(self.ids, ts, strict=False)}
        with self.passes.timed():
            return self.executor.run(actions, hooks, inputs, targets, loss_fn)

    def _sync_call(self, xs: list[Any], ts: list[Any], loss_fn: LossFn) -> float:
        m, base = self.chunks, self.microbatches
        self.microbatches += m
        self.ids = list(range(m))
        self.passes.start_call(self.ids)
        hooks = SyncHooks(self.passes, base, m, self.checkpoint)
        self._drawn = ("step", m)
        losses = self.run(self.actions, hooks, xs, ts, loss_fn)
        self.passes.finish_sends()
        return sum(losses) / m

    # -- failures ------------------------------------------------------------------

    def begin_call(self, doing: str) -> None:
        """Counts the call; raises a failure settled in the last one, or a broken pipeline."""
        self.agreement.calls += 1
        self.executor.stopped = None
        if self.deferred is not None:
            deferred, self.deferred = self.deferred, None
            raise deferred
        if self.agreement.broken is not None:
            raise PipelineError(
                f"{self.agreement.broken}. The pipeline is unusable: build a new Pipeline"
            )
        if self.agreement.closed_by:
            raise PipelineValueError(
                f"stage(s) {self.agreement.closed_by} closed the pipeline (Pipeline.close()); "
                "call close() on this stage too, then build a new Pipeline"
            )
        self.passes.doing = doing

    def close(self) -> PipelineError | None:
        """``Pipeline.close``: nothing left in flight (collective; see ``FailureAgreement.close``).

        Returns:
            The error this stage raises: a failure reported while closing, or one
            settled in the last call and not raised yet (``async``); else None.
        """
        error = self.agreement.close()
        self.pending_status = None
        if self.stale is not None:
            self.stale.reset()  # the backwards still owed are dropped (flush() runs them)
        self.executor.reset()
        deferred, self.deferred = self.deferred, None
        return error if error is not None else deferred

    def read_status(self, status: Status | None) -> float:
        """The loss ``status`` carries, averaged over the replicas; NaN without one."""
        if status is None:
            return math.nan
        return self.replicas.average_loss(self.agreement.read(status))

    def fail(
        self,
        error: Exception,
        call: str,
        undo: _UndoPoint,
        optimizer: torch.optim.Optimizer | None,
        status_due: bool,
    ) -> float:
        """Settles with the other stages, undoes the call, raises the same error as they do.

        The error raised carries a note (shown with its traceback): the grid
        of the call near where this rank stopped, when it stopped in its list.

        Returns:
            NaN, for a call that raises its error in the next call instead (``async``).
        """
        raised = self.agreement.settle(
            error,
            f"Pipeline.{call} (schedule={self.spec.name!r}) failed",
            status_due=status_due,
            where=self.passes.doing,
        )
        try:
            note = self.stopped_note(call)
        except PipelineError as internal:  # a diagnostic must not replace the settled error
            note = f"(no grid of the call: {internal})"
        if note is not None:
            raised.add_note(note)
        self.pending_status = None  # settled: every status has completed
        if self.agreement.failed_in < self.agreement.calls and self.last_call_undo is not None:
            # async: this stage had finished the failed call and begun the next.
            undo = self.last_call_undo
        self.last_call_undo = None
        undo.undo(optimizer)
        if self.stale is not None:
            self.stale.reset()
        self.executor.reset()
        if self.agreement.raise_in > self.agreement.calls:
            # Another stage was a call ahead: every stage raises in that call.
            raised.__cause__ = error
            self.deferred = raised
            return math.nan
        raise raised from error

    def stopped_note(self, call: str) -> str | None:
        """The grid of the call near the action this rank stopped at; None where it did
        not stop inside its list (a bad argument, a status that said another failed)."""
        if self.executor.stopped is None:
            return None
        actions, k = self.executor.stopped
        compute = [a for a in actions if a.kind in COMPUTE]
        if not compute:
            return None
        # A receive waits for the pass after it; a send follows the pass before it.
        if actions[k].kind.startswith("SEND"):
            stopped = next(a for a in reversed(actions[:k]) if a.kind in COMPUTE)
        else:
            stopped = next((a for a in actions[k:] if a.kind in COMPUTE), compute[-1])
        drawn, m = self._drawn
        p, v, style = self.ranks, self.v, self.spec.placement
        lists = [compute]  # the stream's lists of the other ranks are theirs alone
        if self.stale is None and drawn == "forward":
            lists = [
                [Action("F", j, s) for j in range(m) for s in local_stages(r, p, v, style)]
                for r in range(p)
            ]
        elif self.stale is None:
            lists = [
                compute_actions(self.spec.name, r, p, m, v, costs=self.costs) for r in range(p)
            ]
        timed = self.stale is None
        grid = stopped_grid(lists, self.rank, stopped, p, v, style, m, timed)
        return f"Pipeline.{call} (schedule={self.spec.name!r}) on rank {self.rank}:\n{grid}"

    # -- times and gradients -------------------------------------------------------------

    def lay_out(self) -> list[Action]:
        """This rank's actions of a synchronous call, laid out by the passes' times."""
        return rank_actions(
            self.spec.name, self.rank, self.ranks, self.chunks, self.v, costs=self.costs
        )

    def measured_costs(self) -> PassCosts:
        """Every virtual stage's median ``F``, ``I`` and ``W`` over the calls timed so far
        (each call's the median over its micro-batches), on every rank.

        Each rank times its own stages and an allreduce shares them. They are
        rounded to quarters of the cheapest pass, so timing noise between
        passes that cost the same does not flip the list scheduler's ties.
        """
        n = self.ranks * self.v
        kinds = [k for k in COMPUTE if k != "B"]
        times = torch.zeros(len(kinds), n, dtype=torch.float64)
        for row, kind in enumerate(kinds):
            for s in local_stages(self.rank, self.ranks, self.v, self.spec.placement):
                took = [
                    end - start
                    for a, start, end in self.executor.trace
                    if (a.kind, a.stage) == (kind, s)
                ]
                times[row, s] = float(torch.tensor(took).median()) if took else 0.0
        allreduce(times, "sum", comm=self.comm)
        self.timings.append(times)
        times = torch.stack(self.timings).median(dim=0).values  # alike on every rank
        quarter = float(times.min()) / 4
        if not quarter > 0:  # a pass that took no measurable time: keep the unit costs
            return {k: [1.0] * n for k in kinds}
        return {
            k: [max(1.0, round(c / quarter)) for c in times[row].tolist()]
            for row, k in enumerate(kinds)
        }

    def step_grads(self) -> None:
        """async, before each optimizer step: tied copies summed, replicas averaged."""
        self.sum_tied()
        self.replicas.average()

    def progress(self) -> None:
        """Moves this stage's messages (and, under async, the last call's status)."""
        self.passes.progress()
        if self.pending_status is not None:
            # async: the status started at the end of the last call moves
            # only when polled (no background thread on this comm).
            self.pending_status.handle.done()

    # -- checkpoints -------------------------------------------------------------------

    def extra_state(self) -> dict[str, Any]:
        """The numbering of micro-batches and, for ``async``, the stream's state."""
        state: dict[str, Any] = {
            "microbatches": self.microbatches,
            "eval_calls": self.eval_calls,
            "stream": None,
        }
        if self.stale is not None:
            if self.stale.in_flight() or self.pending_status is not None:
                raise PipelineError(
                    f"Pipeline.state_dict: stage {self.rank} has "
                    f"{self.stale.in_flight()} micro-batch(es) of schedule='async' in flight, "
                    "whose stashed weights and activations cannot be saved; call "
                    "pipe.flush(optimizer) before saving a checkpoint"
                )
            state["stream"] = self.stale.state_dict()
        return state

    def load_extra_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`extra_state` (the same model, balance and schedule)."""
        if (state["stream"] is None) != (self.stale is None):
            saved = "async" if state["stream"] is not None else "a synchronous schedule"
            raise PipelineValueError(
                f"Pipeline.load_state_dict: the state was saved with {saved}, this pipeline "
                f"runs schedule={self.spec.name!r}; load it into the same kind of schedule"
            )
        self.microbatches, self.eval_calls = int(state["microbatches"]), int(state["eval_calls"])
        if self.stale is not None:
            self.stale.load_state_dict(state["stream"])
