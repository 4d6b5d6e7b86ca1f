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
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mpx.collectives import CommLike, Communicator, Handle, allreduce, as_communicator, broadcast
from mpx.pipeline.errors import PipelineRemoteError, PipelineTypeError, PipelineValueError
from mpx.pipeline.partition import (
    check_balance,
    check_no_tied_weights,
    layer_times,
    split_times,
    stage_bounds,
)
from mpx.pipeline.passes import LossFn, Micro, StagePasses
from mpx.pipeline.schedule import SCHEDULES, Op, stage_ops
from mpx.pipeline.stage import Stage
from mpx.pipeline.stale import StaleRunner

__all__ = ["Pipeline"]

CHECKPOINTS = ("never", "except_last", "always")


class Pipeline(nn.Module):
    """A sequential model cut into stages, one per rank of ``comm``.

    Args:
        module: the whole model, built identically on every rank (same seed).
        balance: layers per stage; None measures the layers' times on
            ``sample`` and balances them.
        comm: the pipeline's ranks (stage = rank); the world by default.
        chunks: micro-batches per mini-batch; must divide the batch size.
        schedule: ``"sequential"``, ``"gpipe"``, ``"1f1b"`` or ``"async"``.
        checkpoint: recompute activations in the backward for
            ``"always"``, all but the last micro-batch (``"except_last"``), or
            ``"never"`` (synchronous schedules).
        seed: base of the per-layer dropout seeds (see :mod:`mpx.pipeline.stage`).
        data_parallel_comm: replicas of this stage in other pipelines; gradients
            are averaged over it before each optimizer step.
        sample: a micro-batch sized input for ``balance=None``.
        weight_stashing, weight_prediction, gap_aware, step_every, recompute:
            options of ``schedule="async"`` (see :mod:`mpx.pipeline.stale`).

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
        sample: torch.Tensor | None = None,
        weight_stashing: bool = True,
        weight_prediction: str | None = None,
        gap_aware: str | None = None,
        step_every: int = 1,
        recompute: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Sequential):
            raise PipelineTypeError(
                f"module must be an nn.Sequential, got {type(module).__name__}; wrap the "
                "layers in nn.Sequential(...)"
            )
        if schedule not in SCHEDULES:
            raise PipelineValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
        if checkpoint not in CHECKPOINTS:
            raise PipelineValueError(
                f"checkpoint={checkpoint!r} is not one of {', '.join(CHECKPOINTS)}"
            )
        if not isinstance(chunks, int) or chunks < 1:
            raise PipelineValueError(f"chunks={chunks!r} must be a positive int")
        base = as_communicator(comm)
        # A private duplicate: the pipeline's messages never match the user's.
        self.comm = Communicator.from_mpi(base.mpi, base.timeout)
        # The stages poll their messages between layers (Stage.progress) and
        # wait for them where the schedule needs them; a background thread
        # polling the same handles would only take time from the compute.
        self.comm.background_progress = False
        self.dp_comm = None if data_parallel_comm is None else as_communicator(data_parallel_comm)
        self.num_stages, self.stage_id = self.comm.size, self.comm.rank
        self.first, self.last = self.stage_id == 0, self.stage_id == self.num_stages - 1
        self.chunks, self.schedule, self.checkpoint = chunks, schedule, checkpoint
        if balance is None:
            balance = self._profile(module, sample)
        self.balance = check_balance(balance, len(module), self.num_stages)
        check_no_tied_weights(module, self.balance)
        start, stop = stage_bounds(self.balance, self.stage_id)
        self.stage = Stage(module, start, stop, seed)
        self._passes = StagePasses(self.comm, self.stage)
        if self._passes.boxes:
            self.stage.progress = self._progress
        self._microbatches = 0  # numbers the training micro-batches (dropout seeds)
        self._eval_calls = 0
        self._stale: StaleRunner | None = None
        self._pending_loss: tuple[torch.Tensor, Handle[torch.Tensor]] | None = None
        async_opts = (weight_prediction, gap_aware, step_every, recompute, weight_stashing)
        if schedule == "async":
            # The runner gets what it drives explicitly: the stage's passes and
            # two of this pipeline's steps, never the pipeline itself.
            self._stale = StaleRunner(
                self._passes,
                chunks=chunks,
                checkpoint=checkpoint,
                average_grads=self._average_replica_grads,
                progress=self._progress,
                weight_prediction=weight_prediction,
                gap_aware=gap_aware,
                step_every=step_every,
                recompute=recompute,
                weight_stashing=weight_stashing,
            )
        elif async_opts != (None, None, 1, False, True):
            raise PipelineValueError(
                "weight_stashing, weight_prediction, gap_aware, step_every and recompute "
                f"are options of schedule='async', not of schedule={schedule!r}"
            )

    # -- construction ---------------------------------------------------------

    def _profile(self, module: nn.Sequential, sample: torch.Tensor | None) -> list[int]:
        """The first stage times every layer on ``sample``; everyone gets its balance."""
        times = torch.zeros(len(module), dtype=torch.float64)
        # Every rank raises if the first stage cannot measure, instead of one
        # raising and the rest waiting for its broadcast.
        with self.comm.agreement(
            "Pipeline(balance=None): could not time the layers", error_type=PipelineRemoteError
        ):
            if self.first:
                if sample is None:
                    raise PipelineValueError(
                        "balance=None measures layer times on a sample input: pass "
                        "sample=<one micro-batch> (on the first stage at least), or give balance"
                    )
                times = torch.tensor(layer_times(module, sample), dtype=torch.float64)
        broadcast(times, 0, comm=self.comm)
        return split_times(times.tolist(), self.num_stages)

    @property
    def busy_seconds(self) -> float:
        """Compute time of the last call, less the time spent waiting for messages."""
        return self._passes.busy_seconds

    def _progress(self) -> None:
        self._passes.progress()
        if self._pending_loss is not None:
            # async: the loss broadcast started at the end of the last call
            # moves only when polled (no background thread on this comm).
            self._pending_loss[1].done()

    def local_layers(self) -> dict[int, nn.Module]:
        """This rank's layers by their index in the whole module."""
        return self.stage.layer_modules()

    # -- inputs ---------------------------------------------------------------

    def _split(self, t: torch.Tensor | None, what: str, needed: bool) -> list[torch.Tensor]:
        if t is None:
            if needed:
                raise PipelineValueError(
                    f"{what} is None on stage {self.stage_id}, which reads it; pass {what} "
                    "on this rank"
                )
            return []
        if t.dim() == 0 or t.shape[0] % self.chunks:
            raise PipelineValueError(
                f"{what} has batch size {t.shape[0] if t.dim() else 'none'}, not divisible by "
                f"chunks={self.chunks}; use a batch size that is a multiple of chunks"
            )
        return list(t.chunk(self.chunks))

    # -- public API -------------------------------------------------------------

    def step(
        self,
        inputs: torch.Tensor | None,
        target: torch.Tensor | None,
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
        """
        xs = self._split(inputs, "inputs", self.first)
        ts = self._split(target, "target", self.last)
        if self._stale is not None:
            return self._share_loss_later(self._stale.call(xs, ts, loss_fn, optimizer, scheduler))
        else:
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
            loss = self._sync_call(xs, ts, loss_fn)
            self._average_replica_grads()
            if optimizer is not None:
                optimizer.step()
                if scheduler is not None:
                    scheduler.step()
        return self._share_loss(loss)

    def _sync_call(self, xs: list[torch.Tensor], ts: list[torch.Tensor], loss_fn: LossFn) -> float:
        m, base = self.chunks, self._microbatches
        self._microbatches += m
        passes = self._passes
        passes.start_call(list(range(m)))
        live: dict[int, Micro] = {}
        total = 0.0
        ops: list[Op] = stage_ops(self.schedule, self.stage_id, self.num_stages, m)
        with passes.timed():
            for kind, j in ops:
                if kind == "F":
                    mb = passes.input(j, xs[j] if self.first else None)
                    mb.target = ts[j] if self.last else None
                    mb.recompute = self.checkpoint == "always" or (
                        self.checkpoint == "except_last" and j < m - 1
                    )
                    passes.forward(j, mb, base + j, loss_fn)
                    if mb.loss is not None:
                        total += float(mb.loss.detach())
                    live[j] = mb
                else:
                    passes.backward(j, live.pop(j), base + j, loss_fn, 1.0 / m)
        passes.finish_sends()
        return total / m

    def _average_replica_grads(self) -> None:
        if self.dp_comm is None or self.dp_comm.size == 1:
            return
        for p in self.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            allreduce(p.grad, "avg", comm=self.dp_comm)

    def _share_loss(self, loss: float) -> float:
        value = torch.tensor([loss], dtype=torch.float64)
        broadcast(value, self.num_stages - 1, comm=self.comm)
        if self.dp_comm is not None and self.dp_comm.size > 1:
            allreduce(value, "avg", comm=self.dp_comm)
        return float(value)

    def _share_loss_later(self, loss: float | None) -> float:
        """Starts sharing ``loss``; returns the one shared before (NaN if none)."""
        previous = self._pending_loss
        self._pending_loss = None
        if loss is not None:
            value = torch.tensor([loss], dtype=torch.float64)
            handle = broadcast(value, self.num_stages - 1, comm=self.comm, async_op=True)
            self._pending_loss = (value, handle)
        if previous is None:
            return float("nan")
        previous[1].wait()
        if self.dp_comm is not None and self.dp_comm.size > 1:
            allreduce(previous[0], "avg", comm=self.dp_comm)
        return float(previous[0])

    def forward(self, inputs: torch.Tensor | None) -> torch.Tensor | None:
        """Forward only, without gradients; the output on the last stage, None elsewhere.

        Micro-batches follow ``chunks`` (the batch must divide). In training
        mode dropout draws from a stream apart from ``step``'s.
        """
        xs = self._split(inputs, "inputs", self.first)
        m = self.chunks
        passes = self._passes
        # ``async`` leaves its last sends in flight; their slots are reused here.
        passes.finish_sends()
        passes.start_call(list(range(m)))
        self._eval_calls += 1
        outs = []
        with torch.no_grad():
            for j in range(m):
                mb = passes.input(j, xs[j] if self.first else None)
                y = self.stage.run(mb.feed, -self._eval_calls * m - j)
                if self.last:
                    outs.append(y)
                else:
                    assert passes.act_out is not None
                    passes.act_out.send(j, y)
                    passes.act_out.wait(j)
                if mb.buf is not None:
                    assert passes.act_in is not None
                    passes.act_in.release(mb.buf)
        passes.finish_sends()
        return torch.cat(outs) if self.last else None

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
        self._stale.flush(optimizer, scheduler)
        return self._share_loss_later(None)

    def __call__(self, inputs: torch.Tensor | None) -> torch.Tensor | None:  # typed call
        return super().__call__(inputs)  # type: ignore[no-any-return]

    def extra_repr(self) -> str:
        return (
            f"stage={self.stage_id}/{self.num_stages}, balance={self.balance}, "
            f"chunks={self.chunks}, schedule={self.schedule!r}"
        )
