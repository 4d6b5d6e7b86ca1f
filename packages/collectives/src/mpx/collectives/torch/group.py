"""The ``"mpx"`` process group's base: what torch needs of a group besides its collectives.

:class:`GroupBase` is a Python subclass of ``dist.ProcessGroup`` over an mpx
:class:`~mpx.collectives.core.communicator.Communicator`: the group's name and
backend as torch asks for them, its ``shutdown``, the works (:class:`MPXWork`)
its operations return, bounded by the group's timeout, and point to point and
the barrier. :class:`~mpx.collectives.torch.process_group.MPXProcessGroup`
adds the collectives (:mod:`mpx.collectives.torch.backend` registers it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from mpi4py import MPI

from mpx.collectives.base import Handle, MPXTypeError, MPXValueError, on_builtin_comm_hook
from mpx.collectives.core import Communicator, choose, current_policy, implementation, ops
from mpx.collectives.node import flags_take
from mpx.collectives.torch.eager import make_eager, run_eagerly
from mpx.collectives.torch.forms import BITWISE, ReduceForm, bytes_of, reduce_op, versions_as_gloo
from mpx.collectives.torch.work import AnySourceReceive, Deferred, MPXWork, in_turn

__all__ = ["BACKEND_NAME", "GroupBase", "note_builtin_hooks"]

BACKEND_NAME = "mpx"
"""The name torch.distributed knows the backend by: ``dist.init_process_group("mpx")``."""


@run_eagerly
class GroupBase(dist.ProcessGroup):
    """The ``"mpx"`` process group as torch sees it, less its collectives.

    Its identity and lifetime for torch (name, backend, ``shutdown``), the
    works its operations return, point to point and the barrier. The
    collectives are :class:`~mpx.collectives.torch.process_group.MPXProcessGroup`'s,
    the class users and torch hold.
    """

    def __init__(self, comm: Communicator, timeout: timedelta | None = None) -> None:
        super().__init__(comm.rank, comm.size)  # type: ignore[call-arg]
        self.comm = comm
        # Every operation of the group is bounded by the group's timeout.
        self.timeout_s = None if timeout is None else timeout.total_seconds()
        self._group_name = ""
        self._shut = False
        self._group_desc = ""
        # Whether torch's C++ reads this group's futures as c10 tensor lists
        # (a built-in comm hook registered on a DDP over it): see cpp_reads_lists.
        self._cpp_reads_lists = False
        make_eager()
        note_builtin_hooks()  # "mpx" may come from torch's entry point, not register_torch_backend

    def cpp_reads_lists(self) -> None:
        """From now on torch's C++ gets this group's futures as c10 tensor lists.

        torch's built-in comm hooks (``BuiltinCommHookType.FP16_COMPRESS``)
        read a future's value in C++ as a tensor list; DDP's default reduction
        (no hook, or a Python hook) reads a Python value as well. A tensor-list
        future costs a TorchScript task per operation: its call releases the
        GIL, which the progress thread then holds for up to a switch interval
        (~2 ms per bucket measured on the loaded 2-core machine, two inter-op
        threads more), so only groups that need it pay: a DDP registering a
        built-in hook calls this (:func:`note_builtin_hooks`, through
        :func:`mpx.collectives.base._torch_private.on_builtin_comm_hook`). Call it
        yourself before handing the group to other C++ code that reads
        ``getFuture()->value().toTensorList()``.
        """
        self._cpp_reads_lists = True

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend(self, device: Any) -> Any:
        """The backend of ``device``: this group itself, which torch registered none for.

        torch 2.14's ``batch_isend_irecv`` asks every ProcessGroup (2.13: only an
        exact ProcessGroup) for its backend, to see whether it coalesces; a
        Python group has none registered and torch raised "No backend type
        associated with device type cpu". This one does not coalesce.
        """
        try:
            return super()._get_backend(device)
        except RuntimeError:
            return self

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    # torch keeps a group's name on its C++ backends, which a Python group
    # has none of: ``destroy_process_group(group)`` reads it back from here.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    def shutdown(self) -> None:
        """Frees the group's MPI communicator (``destroy_process_group`` calls it)."""
        if not self._shut:
            self._shut = True
            self.comm.free()

    # -- helpers ------------------------------------------------------------------

    def _work(
        self,
        handles: Sequence[Handle[Any]],
        result: list[torch.Tensor],
        then: Callable[[], None] | None = None,
        source: Callable[[], int] | None = None,
        versions: Callable[[], None] | None = None,
        value: list[list[torch.Tensor]] | None = None,
    ) -> MPXWork:
        """A work of this group: it fails at the group's timeout.

        ``versions`` (:func:`versions_as_gloo`, made as the operation started)
        runs after ``then``; ``value`` is the future's value where it is not
        ``result``.
        """
        if versions is not None:
            then = versions if then is None else in_turn([then, versions])
        return MPXWork(
            handles,
            result,
            then,
            source,
            self.timeout_s,
            lists_for_cpp=self._cpp_reads_lists,
            driven=self.comm.background_progress,
            value=value,
        )

    def _joined(self, works: Sequence[MPXWork], result: list[torch.Tensor]) -> MPXWork:
        """One work over several (the coalesced forms): done when all of them are."""
        handles = [handle for work in works for handle in work._handles]
        return self._work(handles, result, in_turn([work.wait for work in works]))

    def _allreduce_form(self, form: ReduceForm) -> Handle[torch.Tensor]:
        """An in-place allreduce of ``form.tensor``; BAND/BOR/BXOR by gather and fold."""
        if form.op not in BITWISE:
            return ops.allreduce(
                form.tensor, form.op, comm=self.comm, async_op=True, timeout=self.timeout_s
            )
        fold = BITWISE[form.op]
        gathered = self._allgather_bytes(form.tensor)  # any integer dtype, bool too

        def folded() -> torch.Tensor:
            rows = gathered.wait().view(form.tensor.dtype).reshape(self.comm.size, -1)
            out = rows[0].clone()
            for row in rows[1:]:
                out = fold(out, row)
            form.tensor.copy_(out.reshape(form.tensor.shape))
            return form.tensor

        return Deferred(gathered, folded)  # type: ignore[return-value]

    def _allreduce_pieces(self, form: ReduceForm) -> list[Handle[torch.Tensor]]:
        """``_allreduce_form``, in pieces shm's flag kernel takes where the whole is past it.

        DDP's buckets (25 MB) are past ``MPX_SHM_FLAG_BYTES`` (4 MiB), so ``auto``
        gave them shm's Python pieces: two barriers and a turn of the progress
        thread each. Pieces of at most that size run the flag kernel in C, one
        wait a piece; the same sum on every rank (2 ranks, 25 MB, loaded host:
        16.8 -> 12.2 ms of CPU a call). Only where ``auto`` would pick the flag
        kernel for a piece, so every rank cuts alike (the policy is agreed on).
        """
        t = form.tensor
        limit = current_policy().flag_bytes
        if t.is_cuda or limit <= 0 or t.nbytes <= limit or not t.is_contiguous():
            return [self._allreduce_form(form)]
        count = -(-t.nbytes // limit)
        per = -(-t.numel() // count)
        size, op = per * t.element_size(), form.op
        comm = self.comm
        if not flags_take(comm.size, comm.single_node, t.dtype, op, size, limit) or (
            choose("allreduce", False, size, comm, None, t.dtype, op) != "shm"
        ):
            return [self._allreduce_form(form)]
        pieces = torch.split(t.view(-1), per)
        return [self._allreduce_form(ReduceForm(piece, piece, op)) for piece in pieces]

    def _allgather_bytes(self, t: torch.Tensor) -> Handle[torch.Tensor]:
        data, _ = bytes_of(t)
        return ops.allgather(data, comm=self.comm, async_op=True, timeout=self.timeout_s)

    def _check_root(self, root: int, op: str) -> int:
        if not 0 <= root < self.comm.size:
            raise MPXValueError(f"{op}: root must be a rank in [0, {self.comm.size}), got {root}")
        return root

    # -- point to point ------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> MPXWork:
        data, _ = bytes_of(tensors[0])
        handle = ops.send(data, dstRank, tag, comm=self.comm, async_op=True, timeout=self.timeout_s)
        return self._work([handle], tensors)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> MPXWork:
        versions = versions_as_gloo(tensors)
        target, write_back = bytes_of(tensors[0])
        handle = ops.recv(
            target, srcRank, tag, comm=self.comm, async_op=True, timeout=self.timeout_s
        )
        return self._work([handle], tensors, write_back, lambda: srcRank, versions)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> MPXWork:
        versions = versions_as_gloo(tensors)
        target, write_back = bytes_of(tensors[0])
        # The implementation the policy chooses for recv, from the registry, as
        # for every receive: only its source is MPI's any.
        nbytes = target.numel() * target.element_size()
        name = choose("recv", target.is_cuda, nbytes, self.comm, None, target.dtype)
        receive = AnySourceReceive(
            implementation(name).function("recv")(self.comm, target, MPI.ANY_SOURCE, tag)
        )
        handle = self.comm.run("recv", name, receive.steps, True, self.timeout_s)
        return self._work([handle], tensors, write_back, receive.source, versions)

    def barrier(self, opts: Any = None) -> MPXWork:
        return self._work([ops.barrier(comm=self.comm, async_op=True, timeout=self.timeout_s)], [])

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        raise MPXTypeError(
            "monitored_barrier: torch implements it for gloo only; on mpx use dist.barrier() "
            "(it raises CollectiveTimeout naming the ranks behind after the group's timeout)"
        )

    # -- options -------------------------------------------------------------------------

    @staticmethod
    def reduce_op_name(opts: Any, where: str) -> str:
        """mpx's name of the ReduceOp in torch's options (or a bare ReduceOp); sum if None."""
        if opts is None:
            return "sum"
        return reduce_op(getattr(opts, "reduceOp", opts), where)


def note_builtin_hooks() -> None:
    """DDP's registration of a built-in comm hook marks an mpx group as read by C++ (idempotent).

    The built-in hooks run in C++ and read the allreduce's future as a c10
    tensor list (:meth:`GroupBase.cpp_reads_lists`); DDP registers them
    through a private Python method, which :mod:`mpx.collectives.base._torch_private`
    (the package's one user of torch's private APIs) listens to.
    """
    on_builtin_comm_hook(_reads_lists)


def _reads_lists(group: Any) -> None:
    if isinstance(group, GroupBase):
        group.cpp_reads_lists()
