"""The :class:`Pipeline`: one stage of a sequential model per rank.

::

    rank 0 (stage 0)       rank 1 (stage 1)       rank 2 (stage 2)
    inputs -> L0..L2  -->  L3..L4            -->  L5..L6 -> loss_fn(., target)
              grads   <--  grads             <--  backward

Every rank calls ``step`` with the same arguments (``inputs`` is read on the
first stage, ``target`` on the last; other ranks may pass None). The batch is
cut into ``chunks`` micro-batches; the schedule (see :mod:`mpx.pipeline.schedule`)
orders their forward and backward passes. The loss is the mean over
micro-batches of ``loss_fn(output, target)``: for a mean-reduced loss and equal
micro-batches, the loss and gradients of the whole batch.

A call that fails on one stage raises :class:`PipelineRemoteError` on every
stage, naming the stage and its error (see :mod:`mpx.pipeline.failure`), and
is undone: gradients, BatchNorm statistics and micro-batch numbering are as
before the call, so the next call gives what a fresh pipeline would. (``async``
keeps the optimizer steps it took before the failure and restarts its stream.)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from mpx.collectives import CommLike, Communicator, allreduce, as_communicator, broadcast
from mpx.pipeline import border
from mpx.pipeline.build_agreement import agree_on_build, build_fields
from mpx.pipeline.errors import (
    PipelineError,
    PipelineRemoteError,
    PipelineTypeError,
    PipelineValueError,
)
from mpx.pipeline.executor import Executor, Hooks, SyncHooks
from mpx.pipeline.failure import FailureAgreement, Status
from mpx.pipeline.partition import (
    check_balance,
    layer_times,
    split_times,
    stage_bounds,
    tied_groups,
)
from mpx.pipeline.passes import LossFn, Micro, StagePasses
from mpx.pipeline.replicas import ReplicaGradients, compression_config, model_names
from mpx.pipeline.schedule import (
    COMPUTE,
    TIMED,
    Action,
    PassCosts,
    canonical,
    local_stages,
    placement,
    rank_actions,
    rank_of,
)
from mpx.pipeline.schedule import stages_per_rank as _chunks_per_rank
from mpx.pipeline.stage import Stage
from mpx.pipeline.stale import AsyncHooks
from mpx.pipeline.transport import wait_for

__all__ = ["Pipeline"]

CHECKPOINTS = ("never", "except_last", "always")
"""The values of ``Pipeline(checkpoint=...)`` (synchronous schedules)."""

MEASURE_AT = 2
"""``pass_costs="measured"``: the training call whose trace the passes' times come
from (the first pays one-time costs: allocations, lazy initialisation)."""


_SYNCHRONOUS_DEFAULTS = {
    "weight_stashing": True,
    "weight_prediction": None,
    "gap_aware": None,
    "step_every": 1,
    "recompute": False,
    "split_backward": False,
}
"""The async-only options as a synchronous schedule must leave them."""


class _UndoPoint:
    """What a failed call puts back: gradients, BatchNorm statistics, numbering.

    The gradients already in ``.grad`` are set aside (not copied) for the call,
    which accumulates into empty ones; :meth:`keep` adds the two, :meth:`undo`
    puts the old ones back. ``async`` learns that a call succeeded on every
    stage only in the next call, so it may undo the last call too: its
    :meth:`keep` leaves the set-aside gradients intact (a new sum).
    """

    def __init__(self, pipe: Pipeline, set_aside_grads: bool) -> None:
        self.pipe = pipe
        self.counters = (pipe._microbatches, pipe._eval_calls)
        self.statistics = pipe.stage.save_statistics()
        self.params = list(pipe.parameters()) if set_aside_grads else []
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
        self.pipe.stage.restore_statistics(self.statistics)
        self.pipe._microbatches, self.pipe._eval_calls = self.counters


class _EvalHooks(Hooks):
    """``pipe(x)``: forward only, dropout numbered apart from training (negative numbers)."""

    def __init__(self, base: int) -> None:
        self.base = base

    def number(self, j: int) -> int:
        return self.base - j

    def before_forward(self, action: Action, mb: Micro) -> None:
        mb.extra["eval"] = True


class Pipeline(nn.Module):
    """A sequential model cut into stages, one per rank of ``comm``.

    Args:
        module: the whole model, built identically on every rank (same seed).
        balance: layers per stage; None measures the layers' times on
            ``sample`` and balances them.
        comm: the pipeline's ranks (stage = rank); the world by default.
        chunks: micro-batches per mini-batch; must divide the batch size.
        schedule: one of :data:`~mpx.pipeline.schedule.SCHEDULES` (or torch's
            name, e.g. ``"Interleaved1F1B"``).
        stages_per_rank: chunks (virtual stages) per rank for the interleaved
            and V-shaped schedules (default 2) and ``async`` (default 1);
            ``balance`` then has one entry per virtual stage.
        checkpoint: recompute activations in the backward for
            ``"always"``, all but the last micro-batch (``"except_last"``), or
            ``"never"`` (synchronous schedules).
        seed: base of the per-layer dropout seeds (see :mod:`mpx.pipeline.stage`).
        data_parallel_comm: replicas of this stage in other pipelines; gradients
            are averaged over it before each optimizer step.
        compression: None (exact), or an ``mpx.quantize.CompressionConfig`` (or
            its bits): the replicas' average is quantized (:mod:`mpx.pipeline.replicas`).
        sample: a micro-batch sized input for ``balance=None``.
        weight_stashing, weight_prediction, gap_aware, step_every, recompute, split_backward:
            options of ``schedule="async"`` (see :mod:`mpx.pipeline.stale`);
            ``split_backward`` runs each backward as ``I`` (sent upstream at once),
            then ``W`` (deferred into idle time); with ``stages_per_rank >= 2``
            every chunk is an asynchronous stage of its own.
        pass_costs: ``interleaved_zb`` and ``zbv`` lay their ``W`` out by the
            passes' times (:data:`~mpx.pipeline.schedule.TIMED`):
            ``"measured"`` (default) takes them from training call
            :data:`MEASURE_AT`'s trace, the median ``F``, ``I`` and ``W`` of
            each virtual stage, shared by every rank, and lays out the calls
            after it with them; ``"unit"`` keeps the Zero Bubble paper's unit
            costs; or a :data:`~mpx.pipeline.schedule.PassCosts` mapping. The
            layout changes when passes run, never what they compute (each
            stage runs its passes in micro-batch order): losses and gradients
            are bit for bit the same.

    Example::

        pipe = Pipeline(nn.Sequential(a, b, c, d), balance=[2, 2], chunks=4)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        loss = pipe.step(x, y, nn.functional.cross_entropy, opt)
    """

    def __init__(
        self,
        module: nn.Sequential,
        balance: list[int] | None = None,
        comm: CommLike | None = None,
        chunks: int = 1,
        schedule: str = "gpipe",
        checkpoint: str = "never",
        *,
        seed: int = 0,
        data_parallel_comm: CommLike | None = None,
        sample: Any = None,
        weight_stashing: bool = True,
        weight_prediction: str | None = None,
        gap_aware: str | None = None,
        step_every: int = 1,
        recompute: bool = False,
        stages_per_rank: int | None = None,
        split_backward: bool = False,
        pass_costs: PassCosts | str = "measured",
        compression: Any = None,
    ) -> None:
        super().__init__()
        base = as_communicator(comm)
        # A private duplicate: the pipeline's messages never match the user's.
        self.comm = Communicator.from_mpi(base.mpi, base.timeout)
        dp_comm = None if data_parallel_comm is None else as_communicator(data_parallel_comm)
        async_options = {
            "weight_stashing": weight_stashing,
            "weight_prediction": weight_prediction,
            "gap_aware": gap_aware,
            "step_every": step_every,
            "recompute": recompute,
            "split_backward": split_backward,
        }
        # First, before any argument is validated or anything moves (build_agreement).
        agree_on_build(
            self.comm,
            build_fields(
                module,
                balance,
                chunks,
                schedule,
                stages_per_rank,
                pass_costs,
                0 if dp_comm is None else dp_comm.size,
                async_options,
                compression,
            ),
            dp_comm,
        )
        if not isinstance(module, nn.Sequential):
            raise PipelineTypeError(
                f"module must be an nn.Sequential, got {type(module).__name__}; wrap the "
                "layers in nn.Sequential(...)"
            )
        schedule = canonical(schedule)
        v = _chunks_per_rank(schedule, stages_per_rank)
        if checkpoint not in CHECKPOINTS:
            raise PipelineValueError(
                f"checkpoint={checkpoint!r} is not one of {', '.join(CHECKPOINTS)}"
            )
        if not isinstance(chunks, int) or chunks < 1:
            raise PipelineValueError(f"chunks={chunks!r} must be a positive int")
        # The stages poll their messages between layers (Stage.progress) and
        # wait for them where the schedule needs them; a background thread
        # polling the same handles would only take time from the compute.
        self.comm.background_progress = False
        self.dp_comm = dp_comm
        config = compression_config(compression, dp_comm)
        self.num_stages, self.stage_id = self.comm.size, self.comm.rank
        self.chunks, self.schedule, self.checkpoint = chunks, schedule, checkpoint
        self.stages_per_rank, self._style = v, placement(schedule)
        virtual = self.num_stages * v
        if balance is None:
            balance = self._profile(module, sample, virtual)
        self.balance = check_balance(balance, len(module), virtual)
        mine = local_stages(self.stage_id, self.num_stages, v, self._style)
        parts = [stage_bounds(self.balance, s) for s in mine]
        self.stage = Stage(module, parts[0][0], parts[0][1], seed, parts=parts)
        self._passes = StagePasses(self.comm, self.stage, v, self._style)
        # The ranks that read the inputs and the targets (both rank 0 in a V).
        self.first, self.last = self._passes.first, self._passes.last
        self._tied = self._tie(module)
        self._executor = Executor(self._passes)
        named = model_names(self.stage.layer_modules(), list(self.named_parameters()))
        self._replicas = ReplicaGradients(dp_comm, config, named)
        if isinstance(pass_costs, str) and pass_costs not in ("measured", "unit"):
            raise PipelineValueError(
                f"pass_costs={pass_costs!r} is not 'measured', 'unit' or a mapping of "
                "'F', 'I' and 'W' to one time per virtual stage"
            )
        self._costs = None if isinstance(pass_costs, str) else pass_costs
        self._measure = pass_costs == "measured" and schedule in TIMED
        self._training_calls = 0  # successful synchronous ones (pass_costs="measured")
        # A schedule that cannot run these sizes (or bad costs) says so now, alike on every
        # rank. The list is kept: laying out a zero-bubble one takes milliseconds (68 at
        # 4 ranks and 16 micro-batches), every call would pay them.
        self._actions = self._lay_out()
        if self._passes.boxes:
            self.stage.progress = self._progress
        self._microbatches = 0  # numbers the training micro-batches (dropout seeds)
        self._ids: list[int] = []  # the micro-batch ids of the call under way
        self._eval_calls = 0
        self._stale: AsyncHooks | None = None
        # Every call ends with a status collective; a stage that fails tells
        # the others at once (mpx.pipeline.failure).
        self._agreement = FailureAgreement(self.comm, self._passes)
        self._agreement.loss_rank = rank_of(virtual - 1, self.num_stages, self._style)
        self._passes.set_interrupt(self._agreement.interrupt)
        self._pending_status: Status | None = None  # async: read by the next call
        self._deferred: PipelineError | None = None  # raised by the next call (failure.py)
        self._last_call_undo: _UndoPoint | None = None  # async: undoes the last call too
        # Decided from the model alone, alike on every rank (owners or not).
        across = any(
            len({rank_of(s, self.num_stages, self._style) for s in by_stage}) > 1
            for by_stage in tied_groups(module, self.balance)
        )
        if schedule == "async" and v > 1 and across:
            # Each chunk steps alone (its own PipeDream stage): copies of a tied
            # weight on different ranks' chunks would step at different times.
            raise PipelineValueError(
                f"schedule='async' with stages_per_rank={v} steps each chunk on its own, "
                "so the copies of a weight tied across ranks would diverge; pass "
                "stages_per_rank=1 (or a synchronous schedule) for a model with tied weights"
            )
        if schedule == "async":
            # The runner gets what it drives explicitly: the stage's passes and
            # two of this pipeline's steps, never the pipeline itself.
            self._stale = AsyncHooks(
                self._passes,
                chunks=chunks,
                checkpoint=checkpoint,
                average_grads=self._step_grads,
                weight_prediction=weight_prediction,
                gap_aware=gap_aware,
                step_every=step_every,
                recompute=recompute,
                weight_stashing=weight_stashing,
                split_backward=split_backward,
            )
        elif async_options != _SYNCHRONOUS_DEFAULTS:
            raise PipelineValueError(
                "weight_stashing, weight_prediction, gap_aware, step_every, recompute and "
                f"split_backward are options of schedule='async', not of schedule={schedule!r}"
                " (the synchronous schedules that split the backward are interleaved_zb, "
                "zbv and dualpipev)"
            )

    # -- construction ---------------------------------------------------------

    def _tie(self, module: nn.Sequential) -> list[tuple[nn.Parameter, Communicator, int]]:
        """Per parameter shared with other stages: this stage's copy and the owners' comm.

        Every owner keeps a copy (the module was built alike everywhere) and
        the copies' gradients are summed before each optimizer step, so the
        copies take the same steps and stay equal (Megatron's word embeddings).
        """
        tied = []
        layers = self.stage.layer_modules()
        for by_stage in tied_groups(module, self.balance):
            # Virtual stages to ranks; a weight shared by chunks of one rank is
            # one parameter there and needs nothing.
            owners: dict[int, tuple[int, str]] = {}
            for s, use in sorted(by_stage.items()):
                owners.setdefault(rank_of(s, self.num_stages, self._style), use)
            if len(owners) < 2:
                continue
            # Collective over the pipeline: every stage splits, owners or not.
            group = self.comm.split(0 if self.stage_id in owners else None)
            if group is not None:
                index, name = owners[self.stage_id]
                other = min(r for r in owners if r != self.stage_id)
                tied.append((layers[index].get_parameter(name), group, other))
        return tied

    def _sum_tied_grads(self) -> None:
        """Sums the gradients of tied copies over the stages that own them."""
        for param, group, other in self._tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            handle = allreduce(param.grad, "sum", comm=group, async_op=True)
            # Polled, not blocking: under async the owners reach their steps at
            # different times, and meanwhile this stage's messages and the last
            # call's status (no progress thread on the pipeline's comm) must move,
            # or the owner it waits for never gets here.
            wait_for(handle, group, "allreduce", other, self._progress)

    def _profile(self, module: nn.Sequential, sample: Any, stages: int) -> list[int]:
        """The first stage times every layer on ``sample``; everyone gets its balance."""
        times = torch.zeros(len(module), dtype=torch.float64)
        # Every rank raises if the first stage cannot measure, instead of one
        # raising and the rest waiting for its broadcast.
        with self.comm.agreement(
            "Pipeline(balance=None): could not time the layers", error_type=PipelineRemoteError
        ):
            if self.stage_id == 0:  # virtual stage 0 is rank 0's in every placement
                if sample is None:
                    raise PipelineValueError(
                        "balance=None measures layer times on a sample input: pass "
                        "sample=<one micro-batch> (on the first stage at least), or give balance"
                    )
                times = torch.tensor(layer_times(module, sample), dtype=torch.float64)
        broadcast(times, 0, comm=self.comm)
        # A rank runs several chunks with stages_per_rank > 1: its load is their sum.
        ranks = [rank_of(s, self.num_stages, self._style) for s in range(stages)]
        return split_times(times.tolist(), stages, ranks, self.chunks)

    @property
    def pass_costs(self) -> PassCosts | None:
        """The passes' times the zero-bubble lists are laid out by (None: unit costs, as
        before the measurement of ``pass_costs="measured"``); the same on every rank."""
        return self._costs

    @property
    def busy_seconds(self) -> float:
        """Compute time of the last call, less the time spent waiting for messages."""
        return self._passes.busy_seconds

    @property
    def deferred_bytes(self) -> int:
        """Bytes kept now for weight-gradient passes still owed (``W`` of the split
        backward: each recorded Linear call's input and output gradient; see
        :mod:`mpx.pipeline.deferred`). 0 for the schedules that do not split."""
        return self._passes.held.bytes

    def _progress(self) -> None:
        self._passes.progress()
        if self._pending_status is not None:
            # async: the status started at the end of the last call moves
            # only when polled (no background thread on this comm).
            self._pending_status.handle.done()

    def local_layers(self) -> dict[int, nn.Module]:
        """This rank's layers by their index in the whole module."""
        return self.stage.layer_modules()

    # -- inputs ---------------------------------------------------------------

    def _split(self, t: Any, what: str, needed: bool, parts: int = 0) -> list[Any]:
        """``t`` in ``chunks`` equal micro-batches (training), or in ``parts`` (evaluation).

        Evaluation takes any batch size: ``tensor_split`` makes ``parts``
        micro-batches whose sizes differ by at most one (the last ones shorter).
        """
        if t is None or not needed:
            if needed:
                raise PipelineValueError(
                    f"{what} is None on stage {self.stage_id}, which reads it; pass {what} "
                    "on this rank"
                )
            return []
        if not parts:
            # Training keeps equal micro-batches: the loss is their mean.
            return border.split(t, self.chunks, what)
        tensors, spec = border.flatten(t, what)
        cut = [x.tensor_split(parts) for x in tensors]
        return [border.unflatten(spec, [c[k] for c in cut]) for k in range(parts)]

    def _eval_parts(self, inputs: Any) -> int:
        """The micro-batches of an evaluation call, from rank 0 (stage 0) to every rank.

        ``chunks``, or the batch size where it is smaller; 0 where rank 0's inputs
        are bad (rank 0 raises, the others run nothing). Only rank 0 reads the
        inputs, so the others learn the count from it.
        """
        count = torch.zeros(1, dtype=torch.int64)
        error: Exception | None = None
        if self.first:
            try:
                if inputs is None:
                    self._split(inputs, "inputs", True)  # its error
                tensors, _ = border.flatten(inputs, "inputs")
                sizes = [x.shape[0] if x.dim() else 0 for x in tensors]
                if sizes and min(sizes) < 1:
                    raise PipelineValueError(
                        f"inputs has a tensor of batch size {min(sizes)} (shapes "
                        f"{[tuple(x.shape) for x in tensors]}); evaluation cuts every tensor "
                        "along dim 0 into micro-batches: pass tensors of at least one sample"
                    )
                count[0] = min([self.chunks, *sizes])
            except Exception as bad:  # raised after the count, so no rank waits for it
                error = bad
        broadcast(count, 0, comm=self.comm)
        if error is not None:
            raise error
        return int(count[0])

    # -- public API -------------------------------------------------------------

    def step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> float:
        """One mini-batch: forward, backward, and an optimizer step if given.

        Without an optimizer, gradients accumulate into ``.grad`` (as
        ``loss.backward()`` would); with one, they are zeroed first and the
        step follows the backward. ``scheduler`` is stepped after every
        optimizer step (async: after each of the call's steps, and weight
        prediction reads its future rates).

        Returns:
            The mean micro-batch loss, the same on every rank (and replica).
            ``async`` returns the previous call's loss (NaN on the first call;
            ``flush`` returns the last one): sharing it at once would make
            every call wait for the last stage, a flush in all but name.

        Raises:
            PipelineRemoteError: on every stage, when the call failed on one
                (its arguments, a layer, the loss, a backward); the call is
                undone. ``async`` may raise it in the next call, on every
                stage alike; the stage that failed returns NaN meanwhile.
            PipelineError: the stages could not settle a failure in time.
        """
        self._begin_call("checking the arguments")
        if self._stale is not None:
            return self._async_step(inputs, target, loss_fn, optimizer, scheduler)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        undo = _UndoPoint(self, set_aside_grads=True)
        status_due = True
        try:
            xs = self._split(inputs, "inputs", self.first)
            ts = self._split(target, "target", self.last)
            loss = self._sync_call(xs, ts, loss_fn)
            status = self._agreement.issue(loss, ok=True)
            status_due = False
            loss = self._agreement.read(status)
        except Exception as error:
            return self._fail(error, "step", undo, optimizer, status_due)
        # This call's gradients only (the earlier ones, set aside, were summed).
        self._sum_tied_grads()
        undo.keep()
        self._training_calls += 1
        if self._measure and self._training_calls == MEASURE_AT:
            self._costs = self._measured_costs()
            self._actions = self._lay_out()
        self._average_replica_grads()
        if optimizer is not None:
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
        return self._average_replica_loss(loss)

    def _async_step(
        self,
        inputs: Any,
        target: Any,
        loss_fn: LossFn,
        optimizer: torch.optim.Optimizer | None,
        scheduler: Any,
    ) -> float:
        assert self._stale is not None
        # With an optimizer the call steps (and zeroes) the gradients itself:
        # a failure drops the ones accumulated toward the next step.
        undo = _UndoPoint(self, set_aside_grads=optimizer is None)
        status_due = True
        try:
            xs = self._split(inputs, "inputs", self.first)
            ts = self._split(target, "target", self.last)
            self._ids, actions = self._stale.begin(optimizer, scheduler)
            self._passes.start_call(self._ids)
            losses = self._run(actions, self._stale, xs, ts, loss_fn)
            # The last sends stay in flight into the next call (the Outboxes hold
            # their tensors): waiting here would stall this stage until its
            # neighbour, busy computing, polls for them. ``flush`` waits for them.
            self._progress()
            loss = sum(losses) / len(losses) if losses else 0.0
            # Reading this call's status at once would make every call wait
            # for the last stage, a flush in all but name: the next call reads it.
            previous, self._pending_status = self._pending_status, None
            self._pending_status = self._agreement.issue(loss, ok=True)
            status_due = False
            shared = self._read_status(previous)
        except Exception as error:
            return self._fail(error, "step", undo, optimizer, status_due)
        undo.keep(in_place=False)
        self._last_call_undo = undo
        return shared

    def _read_status(self, status: Status | None) -> float:
        """The loss ``status`` carries, averaged over the replicas; NaN without one."""
        if status is None:
            return math.nan
        return self._average_replica_loss(self._agreement.read(status))

    def _fail(
        self,
        error: Exception,
        call: str,
        undo: _UndoPoint,
        optimizer: torch.optim.Optimizer | None,
        status_due: bool,
    ) -> float:
        """Settles with the other stages, undoes the call, raises the same error as they do.

        Returns:
            NaN, for a call that raises its error in the next call instead (``async``).
        """
        raised = self._agreement.settle(
            error,
            f"Pipeline.{call} (schedule={self.schedule!r}) failed",
            status_due=status_due,
            where=self._passes.doing,
        )
        self._pending_status = None  # settled: every status has completed
        if self._agreement.failed_in < self._agreement.calls and self._last_call_undo is not None:
            # async: this stage had finished the failed call and begun the next.
            undo = self._last_call_undo
        self._last_call_undo = None
        undo.undo(optimizer)
        if self._stale is not None:
            self._stale.reset()
        self._executor.reset()
        if self._agreement.raise_in > self._agreement.calls:
            # Another stage was a call ahead: every stage raises in that call.
            raised.__cause__ = error
            self._deferred = raised
            return math.nan
        raise raised from error

    def _begin_call(self, doing: str) -> None:
        """Counts the call; raises a failure settled in the last one, or a broken pipeline."""
        self._agreement.calls += 1
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            raise deferred
        if self._agreement.broken is not None:
            raise PipelineError(
                f"{self._agreement.broken}. The pipeline is unusable: build a new Pipeline"
            )
        self._passes.doing = doing

    def _run(
        self, actions: list[Action], hooks: Hooks, xs: list[Any], ts: list[Any], loss_fn: Any
    ) -> list[float]:
        """Runs this rank's actions of a call: the one executor, for every schedule."""
        inputs = {j: x for j, x in zip(self._ids, xs, strict=False)}
        targets = {j: t for j, t in zip(self._ids, ts, strict=False)}
        with self._passes.timed():
            return self._executor.run(actions, hooks, inputs, targets, loss_fn)

    def _sync_call(self, xs: list[Any], ts: list[Any], loss_fn: LossFn) -> float:
        m, base = self.chunks, self._microbatches
        self._microbatches += m
        self._ids = list(range(m))
        self._passes.start_call(self._ids)
        hooks = SyncHooks(self._passes, base, m, self.checkpoint)
        losses = self._run(self._actions, hooks, xs, ts, loss_fn)
        self._passes.finish_sends()
        return sum(losses) / m

    def _lay_out(self) -> list[Action]:
        """This rank's actions of a synchronous call, laid out by :attr:`pass_costs`."""
        return rank_actions(
            self.schedule,
            self.stage_id,
            self.num_stages,
            self.chunks,
            self.stages_per_rank,
            costs=self._costs,
        )

    def _measured_costs(self) -> PassCosts:
        """Every virtual stage's median ``F``, ``I`` and ``W`` of the last call, on every rank.

        Each rank times its own stages and an allreduce shares them. They are
        rounded to quarters of the cheapest pass, so timing noise between
        passes that cost the same does not flip the list scheduler's ties.
        """
        n = self.num_stages * self.stages_per_rank
        kinds = [k for k in COMPUTE if k != "B"]
        times = torch.zeros(len(kinds), n, dtype=torch.float64)
        for row, kind in enumerate(kinds):
            for s in local_stages(
                self.stage_id, self.num_stages, self.stages_per_rank, self._style
            ):
                took = [
                    end - start for a, start, end in self.trace if (a.kind, a.stage) == (kind, s)
                ]
                times[row, s] = float(torch.tensor(took).median()) if took else 0.0
        allreduce(times, "sum", comm=self.comm)
        quarter = float(times.min()) / 4
        if not quarter > 0:  # a pass that took no measurable time: keep the unit costs
            return {k: [1.0] * n for k in kinds}
        return {
            k: [max(1.0, round(c / quarter)) for c in times[row].tolist()]
            for row, k in enumerate(kinds)
        }

    def _step_grads(self) -> None:
        """async, before each optimizer step: tied copies summed, replicas averaged."""
        self._sum_tied_grads()
        self._average_replica_grads()

    def _average_replica_grads(self) -> None:
        self._replicas.average()

    def _average_replica_loss(self, loss: float) -> float:
        return self._replicas.average_loss(loss)

    def forward(self, inputs: Any) -> Any:
        """Forward only, without gradients; the output on the last stage, None elsewhere.

        Any batch size: ``chunks`` micro-batches, the last ones a sample shorter
        where ``chunks`` does not divide the batch, one per sample where the batch
        is smaller than ``chunks`` (``step`` needs a batch that ``chunks`` divides).
        In training mode dropout draws from a stream apart from ``step``'s.
        """
        self._begin_call("checking the arguments")
        undo = _UndoPoint(self, set_aside_grads=False)
        status_due = True
        try:
            out = self._forward_call(inputs)
            status = self._agreement.issue(0.0, ok=True)
            status_due = False
            self._agreement.read(status)
        except Exception as error:
            self._fail(error, "forward", undo, None, status_due)
            return None  # (not reached: forward reads its status in the call)
        if self._stale is not None:
            self._last_call_undo = undo
        return out

    def _forward_call(self, inputs: Any) -> Any:
        passes = self._passes
        # ``async`` leaves its last sends in flight; their slots are reused here.
        passes.finish_sends()
        m = self._eval_parts(inputs)
        if not m:
            return None  # rank 0's inputs were bad: it raises, the status tells everyone
        xs = self._split(inputs, "inputs", self.first, parts=m)
        self._ids = list(range(m))
        passes.start_call(self._ids)
        self._eval_calls += 1
        compute = [Action("F", j, s) for j in range(m) for s in passes.stages]
        actions = rank_actions(
            self.schedule,
            self.stage_id,
            self.num_stages,
            m,
            self.stages_per_rank,
            actions=compute,
        )
        # ``async`` keeps its stream's micro-batches live between calls: this
        # call's own go elsewhere.
        ex = self._executor
        kept, ex.live = ex.live, {}
        try:
            with torch.no_grad():
                # Numbered by ``chunks`` (>= m): calls of fewer micro-batches never share a seed.
                self._run(actions, _EvalHooks(-self._eval_calls * self.chunks), xs, [], None)
            passes.finish_sends()
            outs = []
            last = passes.virtual - 1
            for (s, _), mb in sorted(ex.live.items(), key=lambda kv: kv[0][1]):
                if s == last:
                    outs.append(mb.out)
                passes.release_input(mb)
        finally:
            ex.live = kept
        return border.concat(outs) if self.last else None

    def flush(
        self,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any = None,
    ) -> float:
        """``async``: runs the backwards still owed (and their steps).

        It also waits for the messages still in flight (a ``step`` leaves its
        last sends going), so call it before the end of training.

        Returns:
            The loss of the last ``step`` (async), NaN for the other schedules.
        """
        if self._stale is None:
            return float("nan")
        self._begin_call("flushing")
        undo = _UndoPoint(self, set_aside_grads=optimizer is None)
        try:
            actions = self._stale.flush_actions(optimizer, scheduler)
            self._ids = []
            self._run(actions, self._stale, [], [], None)
            self._passes.finish_sends()
            previous, self._pending_status = self._pending_status, None
            loss = self._read_status(previous)
        except Exception as error:
            return self._fail(error, "flush", undo, optimizer, status_due=False)
        undo.keep(in_place=False)
        self._last_call_undo = undo
        return loss

    # -- checkpoints: state_dict() carries these beside the stage's weights ------

    @property
    def trace(self) -> list[tuple[Action, float, float]]:
        """``(action, start, end)`` of every action of the last call on this rank
        (``time.perf_counter`` seconds; see :func:`mpx.pipeline.executor.measured_bubble`)."""
        return self._executor.trace

    def get_extra_state(self) -> dict[str, Any]:
        """The numbering of micro-batches (dropout seeds) and, for ``async``, the
        stream's counters and gap-aware statistics (:meth:`AsyncHooks.state_dict`).

        Raises:
            PipelineError: ``async`` with micro-batches in flight: their stashed
                weights, activations and messages live in this process only;
                call :meth:`flush` first, then save.
        """
        state: dict[str, Any] = {
            "microbatches": self._microbatches,
            "eval_calls": self._eval_calls,
            "stream": None,
        }
        if self._stale is not None:
            if self._stale.in_flight() or self._pending_status is not None:
                raise PipelineError(
                    f"Pipeline.state_dict: stage {self.stage_id} has "
                    f"{self._stale.in_flight()} micro-batch(es) of schedule='async' in flight, "
                    "whose stashed weights and activations cannot be saved; call "
                    "pipe.flush(optimizer) before saving a checkpoint"
                )
            state["stream"] = self._stale.state_dict()
        return state

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`get_extra_state` (the same model, balance and schedule)."""
        if (state["stream"] is None) != (self._stale is None):
            saved = "async" if state["stream"] is not None else "a synchronous schedule"
            raise PipelineValueError(
                f"Pipeline.load_state_dict: the state was saved with {saved}, this pipeline "
                f"runs schedule={self.schedule!r}; load it into the same kind of schedule"
            )
        self._microbatches, self._eval_calls = int(state["microbatches"]), int(state["eval_calls"])
        if self._stale is not None:
            self._stale.load_state_dict(state["stream"])

    def __call__(self, inputs: Any) -> Any:  # typed call
        return super().__call__(inputs)

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_id}/{self.num_stages}, balance={self.balance}, "
            f"chunks={self.chunks}, schedule={self.schedule!r}"
        )
