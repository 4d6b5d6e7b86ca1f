"""``DistributedOptimizer``: gradients averaged in buckets while backward runs.

Parameters are packed into buckets in reverse registration order (the order
backward produces their gradients), one dtype and device per bucket, about
``bucket_mb`` each (the first one small, so communication starts early)::

    registration:  conv1.w conv1.b conv2.w conv2.b fc.w fc.b
    buckets:       #0 [fc.b fc.w]  #1 [conv2.b conv2.w]  #2 [conv1.b conv1.w]

    backward ----[fc]----[conv2]----[conv1]---->| step()
    hooks             ^ #0 full   ^ #1 full     ^ #2 full
    allreduce         [== #0 ==]  [== #1 ==]    [== #2 ==] wait all, copy back, step

A per-parameter ``post_accumulate_grad`` hook counts arrivals; a full bucket
starts its non-blocking allreduce at once (on CPU the hook moves a fresh
gradient into its bucket slot and makes ``p.grad`` a view of it, so further
accumulation happens in place and the allreduce copies nothing in or out).
The buckets in flight advance on mpx-collectives' progress thread where it
has one, else by polling from the hooks. Where every core of a node already
computes, ``overlap="auto"`` leaves all buckets to ``step()`` instead (see
:func:`overlap_pays`).
Buckets start strictly in index order (a full bucket waits for the ones
before it), so every rank starts the same collectives in the same order and
MPI matches them.

Unused parameters: a parameter whose gradient never arrives keeps its bucket
(and every later one) from starting during backward. ``step()`` then starts
the remaining buckets, in order, with zeros in place of the missing
gradients, and all ranks sum a small "used" map: a parameter no rank used
keeps ``grad=None`` (as in a single process), one that some rank used gets
the average with zeros from the others (as DDP). No rank can deadlock: every
rank starts every bucket exactly once per step, in the same order.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mpx.collectives import CommLike, allreduce
from mpx.collectives.building_blocks import checks_enabled, progress_thread_enabled
from mpx.dataparallel.errors import (
    DataParallelError,
    DataParallelMismatchError,
    DataParallelTypeError,
    DataParallelValueError,
)
from mpx.dataparallel.runtime import default_comm
from mpx.dataparallel.synchronous.buckets import (
    Bucket,
    free_buckets,
    make_buckets,
    overlap_pays,
    parameters,
)
from mpx.dataparallel.synchronous.reduction import (
    check_buckets,
    check_choice,
    quantized_allreduce,
    reduce_bucket,
    shared_buckets,
    steps_aside,
)

__all__ = ["DistributedOptimizer", "overlap_pays"]


class DistributedOptimizer(torch.optim.Optimizer):
    """Wraps any torch optimizer: ``step()`` uses gradients averaged over ranks.

    Args:
        optimizer: the optimizer to wrap (its param_groups and state are shared).
        model: the module whose parameters to reduce (all that require grad);
            the optimizer's parameters when None.
        average: average the gradients (True) or sum them.
        compression: None, or an ``mpx.quantize.CompressionConfig``: buckets are
            reduced by ``mpx.quantize.allreduce_tensors`` parameter by parameter, so
            its layer filtering (``exclude``, 1-D, minimum size) applies (needs mpx-quantize).
        bucket_mb: target bucket size in MiB.
        overlap: start each bucket's allreduce from the gradient hooks during
            backward (True), or all of them in ``step()`` (False). ``"auto"``
            (the default): True, unless every bucket is on the CPU of one node
            whose cores are all computing (ranks on the node x torch threads
            >= cores): there the shared-memory reduction is CPU work too and
            would only take turns with backward (measured in BENCHMARKS.md).
        comm: the ranks taking part (world by default).
        impl: the mpx-collectives implementation that reduces the buckets, by
            its name in the registry (``"mpi"``, ``"ring"``, ``"shm"``, or one
            another package registers, such as mpx-quantize's ``"cgx"``: the
            whole bucket quantized with the ``MPX_QUANTIZE_*``/``CGX_*``
            settings); None: the policy's choice (``MPX_COLLECTIVES_IMPL``).
            ``compression=`` instead filters layer by layer.

    Attributes:
        compression_state: with ``compression``, this optimizer's
            ``mpx.quantize.QuantizeState`` (stochastic-rounding generator,
            residuals), its own so that :func:`~mpx.dataparallel.save_resumable`
            can save it and a resumed run rounds as the uninterrupted one; None
            without compression.

    Example::

        opt = DistributedOptimizer(torch.optim.Adam(model.parameters()), model)
        loss_fn(model(x), y).backward()      # buckets reduce while this runs
        opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | None = None,
        average: bool = True,
        compression: Any | None = None,
        bucket_mb: float = 25.0,
        overlap: bool | str = "auto",
        *,
        comm: CommLike | None = None,
        impl: str | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise DataParallelTypeError(
                "DistributedOptimizer wraps a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        if isinstance(optimizer, DistributedOptimizer):
            raise DataParallelTypeError(
                "DistributedOptimizer: the optimizer is already distributed; pass the "
                "optimizer it wraps (.optimizer) or use this one as it is"
            )
        if model is not None and not isinstance(model, nn.Module):
            raise DataParallelTypeError(
                "DistributedOptimizer: model must be an nn.Module or None, got "
                f"{type(model).__name__}"
            )
        if not isinstance(bucket_mb, (int, float)) or bucket_mb <= 0:
            raise DataParallelValueError(
                f"DistributedOptimizer: bucket_mb must be positive, got {bucket_mb!r}"
            )
        check_choice(impl, compression)  # fail now, not in the middle of backward
        self.impl = impl
        # torch.optim.Optimizer.__init__ would rebuild the param groups; share them instead.
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        for name in (
            "_optimizer_step_pre_hooks",
            "_optimizer_step_post_hooks",
            "_optimizer_state_dict_pre_hooks",
            "_optimizer_state_dict_post_hooks",
            "_optimizer_load_state_dict_pre_hooks",
            "_optimizer_load_state_dict_post_hooks",
        ):
            setattr(self, name, getattr(optimizer, name))
        self.comm = default_comm(comm)
        self.op = "avg" if average else "sum"
        self.compression = compression
        self.compression_state: Any | None = None
        if compression is not None:
            self.compression_state = quantized_allreduce("QuantizeState")(compression, self.comm)
        if overlap not in (True, False, "auto"):
            raise DataParallelValueError(
                f"DistributedOptimizer: overlap must be True, False or 'auto', got {overlap!r}"
            )
        self._sync = True
        self._closed = False
        self._next = 0  # the first bucket not started yet
        self._poll = not progress_thread_enabled()
        params, names = parameters(optimizer, model)
        self._names = names
        # Ranks whose models differ would reduce buckets of different layouts
        # and train on garbage: compared once, here (MPX_CHECK=0 skips it).
        self.comm.check_sequence(
            "DistributedOptimizer",
            "parameter",
            [
                f"{names[id(p)]!r} {str(p.dtype).replace('torch.', '')}{list(p.shape)}"
                for p in params
            ],
        )
        # Ranks whose models start from different values diverge silently:
        # the first step compares the parameters themselves (see step()).
        self._compare_parameters = True
        self._params = params
        self._buckets, self._where = make_buckets(
            params, int(bucket_mb * (1 << 20)), self.comm, shared_buckets(impl, compression)
        )
        check_buckets(impl, self._buckets, self.op)
        self.overlap = (
            overlap_pays(self._buckets, self.comm) if overlap == "auto" else bool(overlap)
        )
        self._used = torch.zeros(len(params), dtype=torch.int32)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._arrived)  # type: ignore[no-untyped-call]
            for p in params
        ]

    # -- the optimizer interface ---------------------------------------------------

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise DataParallelError(
            "DistributedOptimizer: add_param_group after wrapping is not supported (the "
            "buckets are fixed); add the group to the inner optimizer before wrapping it"
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Completes a reduction in flight (it is collective), then zeroes the gradients.

        Call it on every rank alike: a rank that started buckets finishes all of
        them here, as ``step()`` would. With ``set_to_none=True`` (the default)
        gradients become None, bucket aliases included: the next backward then
        hands over fresh gradients, which the hooks copy into the bucket slots
        (one pass over memory). Zeroing the slots instead would cost a memset
        and make backward add into them (two passes). With ``set_to_none=False``
        the aliased slots are zeroed in place.
        """
        self._check_open("zero_grad")
        if any(b.handle is not None for b in self._buckets):
            self._finish()
        self._reset()
        aliased: set[int] = set()
        if not set_to_none:
            for bucket in self._buckets:
                if not bucket.views:
                    continue
                assert bucket.flat is not None
                bucket.flat.zero_()
                for p, view in zip(bucket.params, bucket.views, strict=True):
                    if p.grad is view:
                        aliased.add(id(p))
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None or id(p) in aliased:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()

    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None
    ) -> float | None:
        """Waits for the averaged gradients, then steps the wrapped optimizer.

        With a ``closure`` (e.g. LBFGS), each call of it runs backward and the
        reduction anew.
        """
        self._check_open("step")
        if not self._sync:
            raise DataParallelError(
                "DistributedOptimizer.step() inside no_sync(): leave the no_sync() block and "
                "run the last backward of the accumulation outside it, then step()"
            )
        if closure is not None:
            if self._compare_parameters:
                self._compare_parameters = False
                self._check_parameters_agree()
            user_closure = closure

            def reduced_closure() -> float:
                if any(b.handle is not None for b in self._buckets):
                    self._finish()
                self._reset()
                with torch.enable_grad():
                    loss = user_closure()
                self._finish()
                return loss

            loss = self.optimizer.step(reduced_closure)
            self._reset()
            return loss
        self._finish()
        if self._compare_parameters:
            self._compare_parameters = False
            try:
                self._check_parameters_agree()
            except DataParallelMismatchError:
                self._reset()  # nothing in flight: the next step starts clean
                raise
        out = self.optimizer.step()
        self._reset()
        if steps_aside(self.compression, self.compression_state):
            self.compression = None  # when="auto": the plain allreduce was faster everywhere
        return out

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradients accumulate locally inside; the next backward outside reduces the sum.

        Example::

            with opt.no_sync():
                loss_fn(model(x0), y0).backward()
            loss_fn(model(x1), y1).backward(); opt.step()
        """
        self._check_open("no_sync")
        if any(b.handle is not None for b in self._buckets):
            raise DataParallelError(
                "no_sync() entered after a synchronized backward and before step(); enter it "
                "before the accumulation's first backward"
            )
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def close(self) -> None:
        """Completes a reduction in flight and detaches the hooks. Collective, idempotent.

        Call it on every rank alike: a rank that started buckets finishes them
        here, as ``step()`` would. Afterwards ``step()``, ``zero_grad()`` and
        ``no_sync()`` raise; the wrapped optimizer (``.optimizer``) keeps working
        alone (gradients held in the buckets' node-shared memory are copied out,
        and that memory is given back). The communicator is the caller's (or the
        world): it stays open.
        """
        if self._closed:
            return
        if any(b.handle is not None for b in self._buckets):
            self._finish()
        self._reset()
        self.remove_hooks()
        # Each shared bucket holds one of MPI's windows (MPICH: ~2000 a process).
        free_buckets(self._buckets, self.comm)
        self._closed = True

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise DataParallelValueError(
                f"DistributedOptimizer.{what}() after close(): the optimizer no longer reduces "
                "gradients; create a new DistributedOptimizer, or use the optimizer it wrapped "
                "(.optimizer) alone"
            )

    def remove_hooks(self) -> None:
        """Detaches the gradient hooks (the wrapped optimizer keeps working alone)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def __repr__(self) -> str:
        sizes = ", ".join(f"{b.nbytes / (1 << 20):.2f} MiB {b.dtype}" for b in self._buckets)
        return f"DistributedOptimizer({self.optimizer!r}, op={self.op!r}, buckets=[{sizes}])"

    # -- buckets ---------------------------------------------------------------------

    def _check_parameters_agree(self) -> None:
        """Raises on every rank if the parameters' values differ across ranks (first step).

        A digest per parameter, compared once: models initialised differently
        and never synchronised would otherwise train apart without a word.
        """
        if not checks_enabled():
            return
        params = self._params  # registration order: the first differing one is named
        mine = [
            hashlib.blake2b(
                p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(),
                digest_size=8,
            ).hexdigest()
            for p in params
        ]
        every = self.comm.allgather_object(mine)
        for i, p in enumerate(params):
            differ = [r for r, digests in enumerate(every) if digests[i] != every[0][i]]
            if differ:
                raise DataParallelMismatchError(
                    f"DistributedOptimizer: parameter {self._names[id(p)]!r} has different "
                    f"values on rank 0 and rank(s) {differ} at the first step: the models were "
                    "initialised differently and never synchronised, so the ranks would train "
                    "apart; call model = mpx.dataparallel.synchronize(model) before training "
                    "(or seed every rank alike)"
                )

    def _arrived(self, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: ``p.grad`` is final for this backward."""
        index, i = self._where[id(p)]
        bucket = self._buckets[index]
        if bucket.views and p.grad is not bucket.views[i] and p.grad is not None:
            # Alias the gradient to its bucket slot: later backwards accumulate in
            # place there, and the allreduce needs no copy in or out.
            bucket.views[i].copy_(p.grad)
            p.grad = bucket.views[i]
        if not self._sync:
            return
        if bucket.handle is not None or bucket.arrived == len(bucket.params):
            raise DataParallelError(
                f"DistributedOptimizer: the gradient of {self._names[id(p)]!r} arrived twice "
                "before step(); run the accumulation's earlier backwards inside opt.no_sync(), "
                "or call opt.zero_grad() to start over (an mpx.pipeline.Pipeline runs one backward "
                "a micro-batch: give it data_parallel_comm= and compression= instead)"
            )
        bucket.arrived += 1
        if self.overlap:
            while self._next < len(self._buckets):
                nxt = self._buckets[self._next]
                if nxt.arrived < len(nxt.params):
                    break
                self._launch(nxt)
                self._next += 1
            if self._poll:
                # Without mpx-collectives' progress thread, buckets in flight advance
                # only when polled (MPI and shm progress on test): poll from the hooks.
                for b in self._buckets[: self._next]:
                    if b.handle is not None:
                        b.handle.done()

    def _launch(self, bucket: Bucket) -> None:
        flat = bucket.flat
        assert flat is not None
        with torch.no_grad():
            for i, (p, pid, offset) in enumerate(
                zip(bucket.params, bucket.ids, bucket.offsets, strict=True)
            ):
                aliased = bool(bucket.views) and p.grad is bucket.views[i]
                if p.grad is None:
                    self._used[pid] = 0
                    flat[offset : offset + p.numel()].zero_()
                else:
                    self._used[pid] = 1
                    if not aliased:
                        flat[offset : offset + p.numel()].copy_(p.grad.reshape(-1))
        layout = (
            [
                (self._names[id(p)], p.shape, offset)
                for p, offset in zip(bucket.params, bucket.offsets, strict=True)
            ]
            if self.compression is not None
            else []
        )
        bucket.handle = reduce_bucket(
            flat, self.comm, self.compression, self.op, layout, self.compression_state, self.impl
        )

    def _finish(self) -> None:
        """Starts what backward did not, waits for all, writes the gradients back."""
        while self._next < len(self._buckets):
            self._launch(self._buckets[self._next])
            self._next += 1
        used = allreduce(self._used, "sum", comm=self.comm, async_op=True)
        with torch.no_grad():
            for bucket in self._buckets:
                assert bucket.handle is not None
                bucket.handle.wait()
            used.wait()
            for bucket in self._buckets:
                assert bucket.flat is not None
                for i, (p, pid, offset) in enumerate(
                    zip(bucket.params, bucket.ids, bucket.offsets, strict=True)
                ):
                    aliased = bool(bucket.views) and p.grad is bucket.views[i]
                    if int(self._used[pid]) == 0:
                        # No rank produced a gradient: None, as in one process.
                        if aliased:
                            p.grad = None
                        continue
                    if aliased:
                        continue  # reduced in place
                    if bucket.views:
                        p.grad = bucket.views[i]
                    else:
                        part = bucket.flat[offset : offset + p.numel()].view(p.shape)
                        if p.grad is None:
                            p.grad = part.to(p.device, copy=True)
                        else:
                            p.grad.copy_(part)

    def _reset(self) -> None:
        for bucket in self._buckets:
            bucket.arrived = 0
            bucket.handle = None
        self._next = 0
