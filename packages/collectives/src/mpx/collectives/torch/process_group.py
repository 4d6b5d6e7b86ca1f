"""The ``"mpx"`` process group's collectives: torch's c10d operations mapped onto mpx's.

:class:`MPXProcessGroup` is the class torch and users hold
(:mod:`mpx.collectives.torch.backend` registers it as ``"mpx"``); its base,
:class:`~mpx.collectives.torch.group.GroupBase`, is the group as torch sees it
besides these. Every c10d collective is here: the reductions (all_reduce,
reduce, reduce_scatter and their tensor/coalesced forms) and the data movers
(broadcast, all_gather, gather, scatter, all_to_all, uneven splits included),
each one or a few mpx operations whose results are written back into torch's
tensors as gloo writes them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from mpi4py import MPI

from mpx.collectives.base import Handle, MPXValueError
from mpx.collectives.core import Communicator, ops
from mpx.collectives.torch.eager import run_eagerly
from mpx.collectives.torch.forms import BITWISE, ReduceForm, bytes_of, reduce_form, versions_as_gloo
from mpx.collectives.torch.group import GroupBase
from mpx.collectives.torch.work import MPXWork, in_turn

__all__ = ["MPXProcessGroup"]


@run_eagerly
class MPXProcessGroup(GroupBase):
    """The ``"mpx"`` process group: torch collectives on an mpx :class:`Communicator`.

    Example::

        init_process_group()                       # or dist.init_process_group("mpx")
        model = DistributedDataParallel(model)     # gradients averaged by mpx
        dist.all_reduce(t)
    """

    # -- reductions -------------------------------------------------------------------

    def allreduce(self, tensors: Any, opts: Any = None, op: Any = None) -> MPXWork:  # type: ignore[override]
        """``allreduce(tensors, AllreduceOptions)``, or ``allreduce(tensor, op=ReduceOp)``."""
        opts = op if op is not None else opts
        tensors = _all_of(tensors)
        name = self.reduce_op_name(opts, "allreduce")
        if len(tensors) == 1 and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors[0], name)
        versions = versions_as_gloo(tensors)
        # Several tensors (torch's multi-device form): one value over all of them.
        forms = [reduce_form(t, name, "allreduce") for t in tensors]
        combined = forms[0]
        if len(forms) > 1:
            combined = ReduceForm(tensors[0], _fold_local(forms), forms[0].op)
        handles = self._allreduce_pieces(combined)
        if len(forms) == 1 and combined.tensor is combined.original:
            # DDP's bucket: reduced in its own memory, nothing to write back.
            return self._work(handles, tensors, versions=versions)

        def write_back() -> None:
            for form in forms:
                if form is not combined:
                    form.tensor.copy_(combined.tensor)
                form.write_back()

        return self._work(handles, tensors, write_back, versions=versions)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> MPXWork:
        """Each tensor reduced once, from its value before the call (as gloo's flat buffer)."""
        op = self.reduce_op_name(opts, "allreduce_coalesced")
        versions = versions_as_gloo(tensors, 1)  # gloo copies each out of its flat buffer
        forms = [reduce_form(t, op, "allreduce_coalesced") for t in tensors]
        if _share_memory([form.tensor for form in forms]):
            # One tensor twice in the list, or overlapping views: reduced in place,
            # the shared elements would be reduced twice. Reduce copies instead and
            # write them back in order, as gloo does through its flat buffer.
            forms = [ReduceForm(form.original, form.tensor.clone(), form.op) for form in forms]
        handles = [self._allreduce_form(form) for form in forms]

        def write_back() -> None:
            for form in forms:
                form.write_back()

        return self._work(handles, tensors, write_back, versions=versions)

    def reduce(self, tensors: Any, opts: Any = None) -> MPXWork:  # type: ignore[override]
        tensors = _all_of(tensors)
        op = self.reduce_op_name(opts, "reduce")
        root = self._check_root(opts.rootRank if opts is not None else 0, "reduce")
        versions = versions_as_gloo(tensors)
        form = reduce_form(tensors[0], op, "reduce")
        if op in BITWISE:  # reduced on every rank, into a scratch copy off the root
            form = ReduceForm(tensors[0], form.tensor.clone(), op)
            handle: Any = self._allreduce_form(form)
        else:
            handle = ops.reduce(
                form.tensor, root, form.op, comm=self.comm, async_op=True, timeout=self.timeout_s
            )

        def write_back() -> None:
            if self.comm.rank == root:
                form.write_back()

        return self._work([handle], tensors, write_back, versions=versions)

    def _reduce_scatter_rows(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], op: str, where: str
    ) -> tuple[Handle[torch.Tensor], Callable[[], None]]:
        """Block r of ``inputs`` reduced into rank r's ``outputs[0]``; blocks may differ in size."""
        size = self.comm.size
        if len(inputs) != size:
            raise MPXValueError(
                f"{where}: needs one input tensor per rank ({size}), got {len(inputs)}"
            )
        forms = [reduce_form(t, op, where) for t in inputs]
        widest = max(form.tensor.numel() for form in forms)
        stacked = torch.zeros(
            (size, widest), dtype=forms[0].tensor.dtype, device=forms[0].tensor.device
        )
        for row, form in zip(stacked, forms, strict=True):
            row[: form.tensor.numel()] = form.tensor.reshape(-1)
        out = reduce_form(outputs[0], op, where)
        mine = out.tensor.numel()
        if forms[0].op in BITWISE:
            whole = self._allreduce_form(ReduceForm(stacked, stacked, forms[0].op))

            def take_bitwise() -> None:
                out.tensor.reshape(-1).copy_(whole.wait()[self.comm.rank, :mine])
                out.write_back()

            return whole, take_bitwise
        handle = ops.reduce_scatter(
            stacked, forms[0].op, comm=self.comm, async_op=True, timeout=self.timeout_s
        )

        def take() -> None:
            out.tensor.reshape(-1).copy_(handle.wait()[0, :mine])
            out.write_back()

        return handle, take

    def reduce_scatter(  # type: ignore[override]
        self, outputs: Any, input_lists: Any, opts: Any = None
    ) -> MPXWork:
        outputs = _all_of(outputs)
        if input_lists and isinstance(input_lists[0], torch.Tensor):
            input_lists = [input_lists]
        op = self.reduce_op_name(opts, "reduce_scatter")
        versions = versions_as_gloo(outputs, 1)  # gloo copies each out of its buffer
        steps = [
            self._reduce_scatter_rows([out], list(inputs), op, "reduce_scatter")
            for out, inputs in zip(outputs, input_lists, strict=True)
        ]
        then = in_turn([then for _, then in steps])
        return self._work([h for h, _ in steps], outputs, then, versions=versions)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> MPXWork:
        op = self.reduce_op_name(opts, "reduce_scatter_tensor")
        if input.numel() != output.numel() * self.comm.size:
            raise MPXValueError(
                f"reduce_scatter_tensor: the input has {input.numel()} elements, not "
                f"{self.comm.size} x the output's {output.numel()}"
            )
        versions = versions_as_gloo([output], 1)
        blocks = list(_rows(input.contiguous(), self.comm.size))
        handle, then = self._reduce_scatter_rows([output], blocks, op, "reduce_scatter_tensor")
        return self._work([handle], [output], then, versions=versions)

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        works = [
            self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return self._joined(works, outputs)

    def _sparse_allreduce(self, t: torch.Tensor, op: str) -> MPXWork:
        """Sums sparse COO tensors as gloo does: every rank's entries, coalesced."""
        if op != "sum":
            raise MPXValueError(
                f"allreduce: a sparse tensor can only be summed, got {op!r}; use SUM"
            )
        local = t.coalesce()
        indices, values = local.indices().contiguous(), local.values().contiguous()
        counts = ops.allgather(
            torch.tensor([indices.shape[1]], dtype=torch.int64),
            comm=self.comm,
            timeout=self.timeout_s,
        )
        widest = int(counts.max())
        padded_i = torch.zeros((indices.shape[0], widest), dtype=torch.int64)
        padded_i[:, : indices.shape[1]] = indices
        padded_v = torch.zeros((widest, *values.shape[1:]), dtype=values.dtype)
        padded_v[: values.shape[0]] = values
        all_i = ops.allgather(padded_i, comm=self.comm, timeout=self.timeout_s)
        all_v = self._allgather_bytes(padded_v).wait()
        all_v = all_v.view(values.dtype).reshape(self.comm.size, *padded_v.shape)
        keep = [int(n) for n in counts.reshape(-1)]
        summed = torch.sparse_coo_tensor(
            torch.cat([all_i[r][:, :n] for r, n in enumerate(keep)], dim=1),
            torch.cat([all_v[r][:n] for r, n in enumerate(keep)]),
            t.shape,
            check_invariants=False,  # built from valid tensors: skip the check and its warning
        ).coalesce()
        t.copy_(summed)
        return self._work([], [t])

    # -- data movement ---------------------------------------------------------------

    def broadcast(  # type: ignore[override]
        self, tensors: Any, opts: Any = None, root: int | None = None
    ) -> MPXWork:
        """``broadcast(tensors, BroadcastOptions)``, or ``broadcast(tensor, root)``."""
        opts = root if root is not None else opts
        tensors = _all_of(tensors)
        if isinstance(opts, int):  # pg.broadcast(tensor, root)
            root, index = opts, 0
        else:
            root = opts.rootRank if opts is not None else 0
            index = opts.rootTensor if opts is not None else 0
        self._check_root(root, "broadcast")
        versions = versions_as_gloo(tensors[index : index + 1])  # the others: copied, as gloo
        data, write_back = bytes_of(tensors[index])
        handle = ops.broadcast(data, root, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def then() -> None:
            write_back()
            for i, t in enumerate(tensors):
                if i != index:
                    t.copy_(tensors[index])

        return self._work([handle], tensors, then, versions=versions)

    def allgather(self, output_lists: Any, inputs: Any, opts: Any = None) -> MPXWork:
        """c10d's form: ``k`` inputs per rank, ``k`` output lists of ``size * k`` tensors.

        As gloo: every output list receives every rank's every input,
        ``output_lists[i][r * k + j]`` = rank r's ``inputs[j]``.
        """
        inputs = _all_of(inputs)
        if output_lists and isinstance(output_lists[0], torch.Tensor):
            output_lists = [output_lists]
        k, size = len(inputs), self.comm.size
        if len(output_lists) != k:
            raise MPXValueError(
                f"all_gather: needs one output list per input tensor ({k}), got "
                f"{len(output_lists)} (c10d's form: allgather(output_lists, inputs))"
            )
        for outputs in output_lists:
            if len(outputs) != size * k and k == 1:
                raise MPXValueError(
                    f"all_gather: needs one output tensor per rank ({size}), got {len(outputs)}"
                )
            if len(outputs) != size * k:
                raise MPXValueError(
                    f"all_gather: each output list needs world size x inputs = {size} x {k} = "
                    f"{size * k} tensors (output[r * {k} + j] receives rank r's input j), "
                    f"got {len(outputs)}"
                )
        flat = [t for outs in output_lists for t in outs]
        versions = versions_as_gloo(flat, 1)  # gloo copies each out of its buffer
        handles = [self._allgather_bytes(t) for t in inputs]

        def scatter_rows() -> None:
            for j, handle in enumerate(handles):
                gathered = handle.wait()
                for outputs in output_lists:
                    _copy_rows(gathered, outputs[j::k], "all_gather")

        # gloo's future: the output list itself for one input, else one list per input.
        nested = None if k == 1 else [list(outputs) for outputs in output_lists]
        return self._work(handles, flat, scatter_rows, versions=versions, value=nested)

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        # torch's order: output_lists[rank][i] receives rank's inputs[i].
        flat = [t for outs in output_lists for t in outs]
        versions = versions_as_gloo(flat, 1)  # gloo copies each out of its buffer
        handles = [self._allgather_bytes(t) for t in inputs]

        def scatter_rows() -> None:
            for i, handle in enumerate(handles):
                _copy_rows(
                    handle.wait(), [outs[i] for outs in output_lists], "all_gather_coalesced"
                )

        # gloo's future: one list per rank, as given (the one list itself at one rank).
        nested = None if len(output_lists) == 1 else [list(outs) for outs in output_lists]
        return self._work(handles, flat, scatter_rows, versions=versions, value=nested)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> MPXWork:
        if output.numel() != input.numel() * self.comm.size:
            raise MPXValueError(
                f"all_gather_into_tensor: the output has {output.numel()} elements, not "
                f"{self.comm.size} x the input's {input.numel()}"
            )
        # gloo copies each rank's block into the output's chunk: one bump per rank
        versions = versions_as_gloo([output], self.comm.size)
        handle = self._allgather_bytes(input)
        target, write_back = bytes_of(output)

        def then() -> None:
            target.copy_(handle.wait().reshape(-1))
            write_back()

        return self._work([handle], [output], then, versions=versions)

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        works = [self._allgather_base(o, i) for o, i in zip(outputs, inputs, strict=True)]
        return self._joined(works, outputs)

    def gather(  # type: ignore[override]
        self, output_lists: Any, inputs: Any, opts: Any = None
    ) -> MPXWork:
        inputs = _all_of(inputs)
        root = self._check_root(opts.rootRank if opts is not None else 0, "gather")
        if self.comm.rank == root and (not output_lists or len(output_lists[0]) != self.comm.size):
            raise MPXValueError(f"gather: the root needs a gather_list of {self.comm.size} tensors")
        outputs = list(output_lists[0]) if output_lists else []
        versions = versions_as_gloo(outputs, 1)  # gloo copies each out of its buffer
        handle = self._allgather_bytes(inputs[0])

        def then() -> None:
            if self.comm.rank == root:
                _copy_rows(handle.wait(), output_lists[0], "gather")

        return self._work([handle], outputs, then, versions=versions)

    def scatter(  # type: ignore[override]
        self, outputs: Any, input_lists: Any, opts: Any = None
    ) -> MPXWork:
        outputs = _all_of(outputs)
        root = self._check_root(opts.rootRank if opts is not None else 0, "scatter")
        versions = versions_as_gloo(outputs)
        target, write_back = bytes_of(outputs[0])
        whole = torch.empty((self.comm.size, target.numel()), dtype=torch.uint8)
        if self.comm.rank == root:
            if not input_lists or len(input_lists[0]) != self.comm.size:
                raise MPXValueError(
                    f"scatter: the root needs a scatter_list of {self.comm.size} tensors"
                )
            for row, t in zip(whole, input_lists[0], strict=True):
                row.copy_(bytes_of(t)[0])
        handle = ops.broadcast(whole, root, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def then() -> None:
            target.copy_(whole[self.comm.rank])
            write_back()

        return self._work([handle], outputs, then, versions=versions)

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> MPXWork:
        size = self.comm.size
        versions = versions_as_gloo([output])  # gloo receives into it
        # c10d's contract, as gloo checks it: the input is whole in its memory format
        # (a strided output is accepted, and written through a copy).
        if not _dense(input):
            raise MPXValueError(
                f"all_to_all_single: Tensors must be contiguous; the input has strides "
                f"{input.stride()} for shape {tuple(input.shape)}: pass input.contiguous()"
            )
        if not input_split_sizes and not output_split_sizes:
            if input.numel() % size:
                raise MPXValueError(
                    f"all_to_all_single: {input.numel()} elements do not split evenly over "
                    f"{size} ranks; pass input_split_sizes and output_split_sizes"
                )
            data, _ = bytes_of(input)
            target, write_back = bytes_of(output)
            handle = ops.alltoall(
                _rows(data, size), comm=self.comm, async_op=True, timeout=self.timeout_s
            )

            def even() -> None:
                target.copy_(handle.wait().reshape(-1))
                write_back()

            return self._work([handle], [output], even, versions=versions)
        rows_in = input_split_sizes or [input.shape[0] // size] * size
        rows_out = output_split_sizes or [output.shape[0] // size] * size
        send = list(torch.split(input, rows_in)) if input.dim() else [input]
        receive = list(torch.split(output, rows_out)) if output.dim() else [output]
        return self._alltoall(receive, send, versions)

    def alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> MPXWork:
        # gloo copies each output out of its buffer
        return self._alltoall(outputs, inputs, versions_as_gloo(outputs, 1))

    def _alltoall(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], versions: Callable[[], None]
    ) -> MPXWork:
        size = self.comm.size
        if len(inputs) != size or len(outputs) != size:
            raise MPXValueError(
                f"all_to_all: needs {size} input and output tensors, got "
                f"{len(inputs)} and {len(outputs)}"
            )
        # Blocks may differ in size: each travels padded to the largest of the job.
        sizes = [t.numel() * t.element_size() for t in inputs]
        widest = ops.allreduce(
            torch.tensor([max(sizes)], dtype=torch.int64),
            "max",
            comm=self.comm,
            timeout=self.timeout_s,
        )
        blocks = torch.zeros((size, int(widest)), dtype=torch.uint8)
        for row, t, n in zip(blocks, inputs, sizes, strict=True):
            row[:n] = bytes_of(t)[0]
        handle = ops.alltoall(blocks, comm=self.comm, async_op=True, timeout=self.timeout_s)

        def unpad() -> None:
            received = handle.wait()
            for row, out in zip(received, outputs, strict=True):
                target, write_back = bytes_of(out)
                target.copy_(row[: target.numel()])
                write_back()

        return self._work([handle], outputs, unpad, versions=versions)

    @classmethod
    def create(cls, options: Any, backend_options: Any = None) -> MPXProcessGroup:
        """torch's creator (``register_backend(..., extended_api=True)``) for this class.

        ``options`` is torch's ``_DistributedBackendOptions``: this rank's place
        in the group, its global ranks and its timeout.
        """
        seconds = None if options.timeout is None else options.timeout.total_seconds()
        comm = _group_communicator(options.global_ranks_in_group, seconds)
        rank, size = options.group_rank, options.group_size
        if (rank, size) != (comm.rank, comm.size):
            comm.free()
            raise MPXValueError(
                f"torch asked for rank {rank} of {size}, but MPI says rank {comm.rank} of "
                f"{comm.size}; start the job with mpxrun/mpiexec and let mpx.collectives."
                "init_process_group() pass MPI's rank and size"
            )
        return cls(comm, options.timeout)

    # torch 2.13's names of the single-tensor forms (all_gather_into_tensor,
    # reduce_scatter_tensor and all_to_all_single call these).
    all_gather_single = _allgather_base
    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]
    reduce_scatter_single = _reduce_scatter_base  # type: ignore[assignment]
    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]
    all_to_all_single = alltoall_base  # type: ignore[assignment]


def _dense(t: torch.Tensor) -> bool:
    """Contiguous in some memory format (channels-last counts, as in c10d's checks)."""
    formats = {4: torch.channels_last, 5: torch.channels_last_3d}
    return t.is_contiguous() or (
        t.dim() in formats and t.is_contiguous(memory_format=formats[t.dim()])
    )


def _all_of(tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """torch's list form of an argument also given as one tensor (``pg.allreduce(t)``)."""
    return [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)


def _rows(stacked: torch.Tensor, size: int) -> torch.Tensor:
    return stacked.reshape(size, -1)


def _share_memory(tensors: Sequence[torch.Tensor]) -> bool:
    """True if two of ``tensors`` use the same storage (the same tensor, or views of one)."""
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage().data_ptr()
        if storage in seen and t.numel():
            return True
        if t.numel():
            seen.add(storage)
    return False


def _fold_local(forms: list[ReduceForm]) -> torch.Tensor:
    """The tensors of one rank reduced together (torch's several-tensors-per-call form)."""
    out = forms[0].tensor.clone()
    for form in forms[1:]:
        other = form.tensor
        if form.op in ("sum", "avg"):
            out += other
        elif form.op == "max":
            out = torch.maximum(out, other)
        elif form.op == "min":
            out = torch.minimum(out, other)
        elif form.op == "prod":
            out *= other
        else:
            out = BITWISE[form.op](out, other)
    if forms[0].op == "avg":
        out /= len(forms)
    return out


def _copy_rows(stacked: torch.Tensor, outputs: Sequence[torch.Tensor], where: str) -> None:
    """Row r of the gathered bytes into ``outputs[r]``."""
    for row, out in zip(_rows(stacked, len(outputs)), outputs, strict=True):
        target, write_back = bytes_of(out)
        if target.numel() != row.numel():
            raise MPXValueError(
                f"{where}: output tensor of {out.numel()} {out.dtype} elements does not match "
                f"the {row.numel()} bytes each rank sent; give every rank the same shape"
            )
        target.copy_(row)
        write_back()


def _group_communicator(ranks: Sequence[int], timeout: float | None) -> Communicator:
    """A communicator of its own for a group of world ranks, made by its members alone.

    torch creates a group only on its members, so the communicator comes
    from ``MPI_Comm_create_group`` (collective over them), not a split of
    the world. Being the group's own, its FIFO keeps the group's operations
    apart from other groups' and from mpx's own calls on :func:`world`, and
    a timeout that breaks it breaks no other group.
    """
    parent = MPI.COMM_WORLD
    members = list(ranks) if ranks else list(range(parent.Get_size()))
    group = parent.Get_group().Incl(members)
    try:
        mpi_comm = parent.Create_group(group, tag=0)
    finally:
        group.Free()
    return Communicator(MPI.Intracomm(mpi_comm), timeout)
