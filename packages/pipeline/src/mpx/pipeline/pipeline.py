"""The :class:`Pipeline`: one stage of a sequential model per rank.

::

    rank 0 (stage 0)       rank 1 (stage 1)       rank 2 (stage 2)
    inputs -> L0..L2  -->  L3..L4            -->  L5..L6 -> loss_fn(., target)
              grads   <--  grads             <--  backward

Every rank calls ``step`` with the same arguments (``inputs`` is read on the
first stage, ``target`` on the last; other ranks may pass None). The batch is
cut into ``chunks`` micro-batches; the schedule (see :mod:`mpx.pipeline.schedules.table`)
orders their forward and backward passes. The loss is the mean over
micro-batches of ``loss_fn(output, target)``: for a mean-reduced loss and equal
micro-batches, the loss and gradients of the whole batch.

A call that fails on one stage raises :class:`PipelineRemoteError` on every
stage, naming the stage and its error (see :mod:`mpx.pipeline.runtime.failure`), and
is undone: gradients, BatchNorm statistics and micro-batch numbering are as
before the call, so the next call gives what a fresh pipeline would. (``async``
keeps the optimizer steps it took before the failure and restarts its stream.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpx.collectives import CommLike, Communicator, allreduce, as_communicator, broadcast
from mpx.pipeline.build_agreement import agree_on_build, build_fields
from mpx.pipeline.errors import PipelineRemoteError, PipelineTypeError, PipelineValueError
from mpx.pipeline.model import (
    Stage,
    check_balance,
    layer_times,
    split_times,
    stage_bounds,
    tied_groups,
)
from mpx.pipeline.runtime import (
    MEASURE_AT,
    MEASURE_CALLS,
    AsyncHooks,
    AsyncOptions,
    LossFn,
    ReplicaGradients,
    Runtime,
    StagePasses,
    compression_config,
    model_names,
    wait_for,
)
from mpx.pipeline.schedules import Action, PassCosts, local_stages, rank_of
from mpx.pipeline.schedules import spec as schedule_spec
from mpx.pipeline.schedules import stages_per_rank as _chunks_per_rank

__all__ = ["MEASURE_AT", "MEASURE_CALLS", "Pipeline"]

CHECKPOINTS = ("never", "except_last", "always")
"""The values of ``Pipeline(checkpoint=...)`` (synchronous schedules)."""


class Pipeline(nn.Module):
    """A sequential model cut into stages, one per rank of ``comm``.

    Args:
        module: the whole model, built identically on every rank (same seed).
        balance: layers per stage; None measures the layers' times on
            ``sample`` and balances them.
        comm: the pipeline's ranks (stage = rank); the world by default.
        chunks: micro-batches per mini-batch; must divide the batch size.
        schedule: one of :data:`~mpx.pipeline.schedules.SCHEDULES` (or torch's
            name, e.g. ``"Interleaved1F1B"``).
        stages_per_rank: chunks (virtual stages) per rank for the interleaved
            and V-shaped schedules (default 2) and ``async`` (default 1);
            ``balance`` then has one entry per virtual stage.
        checkpoint: recompute activations in the backward for
            ``"always"``, all but the last micro-batch (``"except_last"``), or
            ``"never"`` (synchronous schedules).
        seed: base of the per-layer dropout seeds (see :mod:`mpx.pipeline.model.stage`).
        data_parallel_comm: replicas of this stage in other pipelines; gradients
            are averaged over it before each optimizer step.
        compression: None (exact), or an ``mpx.quantize.CompressionConfig`` (or
            its bits): the replicas' average is quantized (:mod:`mpx.pipeline.runtime.replicas`).
        sample: a micro-batch sized input for ``balance=None``.
        weight_stashing, weight_prediction, gap_aware, step_every, recompute, split_backward:
            options of ``schedule="async"`` (see :mod:`mpx.pipeline.runtime.stale`);
            ``split_backward`` runs each backward as ``I`` (sent upstream at once),
            then ``W`` (deferred into idle time); with ``stages_per_rank >= 2``
            every chunk is an asynchronous stage of its own.
        pass_costs: ``interleaved_zb`` and ``zbv`` lay their ``W`` out by the
            passes' times (:data:`~mpx.pipeline.schedules.TIMED`):
            ``"measured"`` (default) takes them from the traces of
            :data:`MEASURE_CALLS` training calls from :data:`MEASURE_AT` on, the
            median ``F``, ``I`` and ``W`` of each virtual stage, shared by every
            rank, and after each of them lays out the calls after it by the
            medians over the calls timed so far; ``"unit"`` keeps the Zero
            Bubble paper's unit costs; or a
            :data:`~mpx.pipeline.schedules.PassCosts` mapping. The
            layout changes when passes run, never what they compute (each
            stage runs its passes in micro-batch order): losses and gradients
            are bit for bit the same.

    Example::

        pipe = Pipeline(nn.Sequential(a, b, c, d), balance=[2, 2], chunks=4)
        opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
        loss = pipe.step(x, y, nn.functional.cross_entropy, opt)
        pipe.close()  # frees its communicators (every rank)
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
        # It and the tied weights' groups are this pipeline's to free (close()).
        self.comm = Communicator.from_mpi(base.mpi, base.timeout)
        self._tied: list[tuple[nn.Parameter, Communicator, int]] = []
        self._closed = False
        try:
            self._build(
                module,
                balance,
                chunks,
                schedule,
                checkpoint,
                seed,
                data_parallel_comm,
                sample,
                AsyncOptions(
                    weight_stashing=weight_stashing,
                    weight_prediction=weight_prediction,
                    gap_aware=gap_aware,
                    step_every=step_every,
                    recompute=recompute,
                    split_backward=split_backward,
                ),
                stages_per_rank,
                pass_costs,
                compression,
            )
        except (PipelineValueError, PipelineRemoteError):
            # Raised on every rank alike (the arguments are agreed on first), so
            # the collective free is safe; a pipeline that was never built is
            # nobody's to close. A timeout is not freed: a rank may be missing.
            self._free()
            raise

    def _build(
        self,
        module: nn.Sequential,
        balance: list[int] | None,
        chunks: int,
        schedule: str,
        checkpoint: str,
        seed: int,
        data_parallel_comm: CommLike | None,
        sample: Any,
        options: AsyncOptions,
        stages_per_rank: int | None,
        pass_costs: PassCosts | str,
        compression: Any,
    ) -> None:
        dp_comm = None if data_parallel_comm is None else as_communicator(data_parallel_comm)
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
                options.as_dict(),
                compression,
            ),
            dp_comm,
        )
        if not isinstance(module, nn.Sequential):
            raise PipelineTypeError(
                f"module must be an nn.Sequential, got {type(module).__name__}; wrap the "
                "layers in nn.Sequential(...)"
            )
        spec = schedule_spec(schedule)
        schedule = spec.name
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
        self.stages_per_rank, self._style = v, spec.placement
        virtual = self.num_stages * v
        if balance is None:
            balance = self._profile(module, sample, virtual)
        self.balance = check_balance(balance, len(module), virtual)
        mine = local_stages(self.stage_id, self.num_stages, v, self._style)
        parts = [stage_bounds(self.balance, s) for s in mine]
        self.stage = Stage(module, parts[0][0], parts[0][1], seed, parts=parts)
        passes = StagePasses(self.comm, self.stage, v, self._style)
        # The ranks that read the inputs and the targets (both rank 0 in a V).
        self.first, self.last = passes.first, passes.last
        self._tie(module)
        named = model_names(self.stage.layer_modules(), list(self.named_parameters()))
        # Decided from the model alone, alike on every rank (owners or not).
        across = any(
            len({rank_of(s, self.num_stages, self._style) for s in by_stage}) > 1
            for by_stage in tied_groups(module, self.balance)
        )
        self._runtime = Runtime(
            self.comm,
            self.stage,
            passes,
            spec,
            chunks=chunks,
            checkpoint=checkpoint,
            v=v,
            pass_costs=pass_costs,
            options=options,
            tied_across_ranks=across,
            parameters=self.parameters,
            replicas=ReplicaGradients(dp_comm, config, named),
            sum_tied=self._sum_tied_grads,
        )

    # -- construction ---------------------------------------------------------

    def _tie(self, module: nn.Sequential) -> None:
        """Per parameter shared with other stages: this stage's copy and the owners' comm
        (in ``self._tied``, each group as it is made: close() frees them).

        Every owner keeps a copy (the module was built alike everywhere) and
        the copies' gradients are summed before each optimizer step, so the
        copies take the same steps and stay equal (Megatron's word embeddings).
        """
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
                self._tied.append((layers[index].get_parameter(name), group, other))

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
            wait_for(handle, group, "allreduce", other, self._runtime.progress)

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
        return self._runtime.costs

    @property
    def busy_seconds(self) -> float:
        """Compute time of the last call, less the time spent waiting for messages."""
        return self._passes.busy_seconds

    @property
    def deferred_bytes(self) -> int:
        """Bytes kept now for weight-gradient passes still owed (``W`` of the split
        backward: each recorded Linear call's input and output gradient; see
        :mod:`mpx.pipeline.split_backward.deferred`). 0 for the schedules that do not split."""
        return self._passes.held.bytes

    @property
    def _passes(self) -> StagePasses:
        """This rank's passes (the runtime's)."""
        return self._runtime.passes

    @property
    def _stale(self) -> AsyncHooks | None:
        """``async``: the stream's hooks (the runtime's); None for the other schedules."""
        return self._runtime.stale

    def local_layers(self) -> dict[int, nn.Module]:
        """This rank's layers by their index in the whole module."""
        return self.stage.layer_modules()

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
        self._check_open("step")
        return self._runtime.step(inputs, target, loss_fn, optimizer, scheduler)

    def forward(self, inputs: Any) -> Any:
        """Forward only, without gradients; the output on the last stage, None elsewhere.

        Any batch size: ``chunks`` micro-batches, the last ones a sample shorter
        where ``chunks`` does not divide the batch, one per sample where the batch
        is smaller than ``chunks`` (``step`` needs a batch that ``chunks`` divides).
        In training mode dropout draws from a stream apart from ``step``'s.
        """
        self._check_open("forward")
        return self._runtime.forward(inputs)

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
        self._check_open("flush")
        if self._runtime.stale is None:
            return float("nan")
        return self._runtime.flush(optimizer, scheduler)

    def close(self) -> None:
        """Frees the communicators this pipeline made. Collective: every stage calls it,
        after the same calls; idempotent.

        The private duplicate of ``comm`` and the tied weights' groups are freed
        (``comm`` itself and ``data_parallel_comm`` stay the caller's). Messages
        still in flight are settled first (``async``: the last call's sends and
        status; call :meth:`flush` before it to keep the backwards still owed).
        Afterwards ``step``, ``forward`` and ``flush`` raise
        :class:`PipelineValueError`; the weights stay usable (``state_dict``).

        Raises:
            PipelineRemoteError: a stage reported a failure that no call raised
                here (``async`` raises a failure a call late); the communicators
                are freed all the same.
            PipelineError: the stages did not settle in time; then nothing is
                freed (MPI may still use the buffers).
        """
        if self._closed:
            return
        self._closed = True
        error = self._runtime.close()
        if self._runtime.agreement.broken is None:
            self._free()
        if error is not None:
            raise error

    def _free(self) -> None:
        for _, group, _ in self._tied:
            group.free()
        self._tied = []
        self.comm.free()

    def _check_open(self, call: str) -> None:
        if self._closed:
            raise PipelineValueError(
                f"Pipeline.{call}: the pipeline is closed (Pipeline.close() freed its "
                "communicators); build a new Pipeline to run it again"
            )

    # -- checkpoints: state_dict() carries these beside the stage's weights ------

    @property
    def trace(self) -> list[tuple[Action, float, float]]:
        """``(action, start, end)`` of every action of the last call on this rank
        (``time.perf_counter`` seconds; see
        :func:`mpx.pipeline.runtime.executor.measured_bubble`)."""
        return self._runtime.executor.trace

    def get_extra_state(self) -> dict[str, Any]:
        """The numbering of micro-batches (dropout seeds) and, for ``async``, the
        stream's counters and gap-aware statistics (:meth:`AsyncHooks.state_dict`).

        Raises:
            PipelineError: ``async`` with micro-batches in flight: their stashed
                weights, activations and messages live in this process only;
                call :meth:`flush` first, then save.
        """
        return self._runtime.extra_state()

    def set_extra_state(self, state: dict[str, Any]) -> None:
        """Restores :meth:`get_extra_state` (the same model, balance and schedule)."""
        self._runtime.load_extra_state(state)

    def __call__(self, inputs: Any) -> Any:  # typed call
        return super().__call__(inputs)

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_id}/{self.num_stages}, balance={self.balance}, "
            f"chunks={self.chunks}, schedule={self.schedule!r}"
        )
