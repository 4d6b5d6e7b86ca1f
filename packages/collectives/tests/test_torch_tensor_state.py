"""What the mpx backend's operations leave on the caller's tensors, against gloo (issue 41).

gloo moves a collective's data through raw pointers: the tensors keep a
resizable storage, and their version counters move only where gloo copies
with torch (all_gather's outputs, ...). mpx handed MPI numpy views
(``t.numpy()`` marks the storage not resizable for good: DDP's bucket buffers
from step 2, torch's batched PowerSGD hook failed on them) and wrote its
forms back with torch copies (a bfloat16 all_reduce bumped the version
gloo's leaves alone). Each case runs on the mpx group and on a gloo group
over the same ranks, and what it left must be the same.
"""

import gc
import weakref
from collections.abc import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mpx.collectives.base.dtypes import numpy_view

# What a case gives back: the caller's tensors to inspect, and what runs the operation.
Case = Callable[
    [dist.ProcessGroup, torch.dtype, int], tuple[list[torch.Tensor], Callable[[], object]]
]


def _ones(n: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(n) % 7 + 1).to(dtype)


def _rank_size() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _all_reduce(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t = _ones(n, dtype)
    return [t], lambda: dist.all_reduce(t, group=g)


def _all_reduce_async(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t = _ones(n, dtype)
    return [t], lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g, async_op=True).wait()


def _all_reduce_strided(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t = _ones(2 * n, dtype)[::2]
    return [t], lambda: dist.all_reduce(t, group=g)


def _broadcast(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t, strided = _ones(n, dtype), _ones(2 * n, dtype)[::2]

    def run() -> None:
        dist.broadcast(t, 0, group=g)
        dist.broadcast(strided, dist.get_world_size() - 1, group=g)

    return [t, strided], run


def _reduce(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t = _ones(n, dtype)
    return [t], lambda: dist.reduce(t, 0, group=g)


def _all_gather(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t = _ones(n, dtype)
    outputs = [torch.zeros(n, dtype=dtype) for _ in range(dist.get_world_size())]
    return [t, *outputs], lambda: dist.all_gather(outputs, t, group=g)


def _all_gather_into_tensor(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    t, out = _ones(n, dtype), torch.zeros(n * dist.get_world_size(), dtype=dtype)
    return [t, out], lambda: g._allgather_base(out, t).wait()


def _reduce_scatter(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    size = dist.get_world_size()
    t, out = _ones(n * size, dtype), torch.zeros(n, dtype=dtype)
    ins, out2 = [_ones(n, dtype) for _ in range(size)], torch.zeros(n, dtype=dtype)

    def run() -> None:
        g._reduce_scatter_base(out, t, dist.ReduceScatterOptions()).wait()
        dist.reduce_scatter(out2, ins, group=g)

    return [t, out, *ins, out2], run


def _allreduce_coalesced(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    ts = [_ones(n, dtype), _ones(3, dtype)]
    return ts, lambda: g.allreduce_coalesced(ts).wait()


def _gather(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    rank, size = _rank_size()
    t = _ones(n, dtype)
    outputs = [torch.zeros(n, dtype=dtype) for _ in range(size)] if rank == 0 else []
    return [t, *outputs], lambda: dist.gather(t, outputs if rank == 0 else None, 0, group=g)


def _scatter(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    rank, size = _rank_size()
    t = torch.zeros(n, dtype=dtype)
    inputs = [_ones(n, dtype) for _ in range(size)] if rank == 0 else []
    return [t, *inputs], lambda: dist.scatter(t, inputs if rank == 0 else None, 0, group=g)


def _all_to_all(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    size = dist.get_world_size()
    t, out, out2 = (
        _ones(n * size, dtype),
        torch.zeros(n * size, dtype=dtype),
        torch.zeros(n * size, dtype=dtype),
    )
    ins, outs = (
        [_ones(n, dtype) for _ in range(size)],
        [torch.zeros(n, dtype=dtype) for _ in range(size)],
    )

    def run() -> None:
        dist.all_to_all_single(out, t, group=g)
        dist.all_to_all_single(out2, t, [n] * size, [n] * size, group=g)
        dist.all_to_all(outs, ins, group=g)

    return [t, out, out2, *ins, *outs], run


def _wait(work: dist.Work | None) -> None:
    assert work is not None  # None only for a rank outside the group
    work.wait()


def _send_recv(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    """Blocking and async send/recv, from a named source and from any, between ranks 0 and 1."""
    rank, size = _rank_size()
    t, u, v = _ones(n, dtype), _ones(n, dtype), _ones(n, dtype)

    def run() -> None:
        if rank == 0 and size > 1:
            dist.send(t, 1, group=g)
            _wait(dist.isend(u, 1, group=g))
            dist.send(v, 1, group=g)
        elif rank == 1:
            dist.recv(t, 0, group=g)
            _wait(dist.irecv(u, 0, group=g))
            dist.recv(v, group=g)  # any source

    return [t, u, v], run


def _batch_p2p(
    g: dist.ProcessGroup, dtype: torch.dtype, n: int
) -> tuple[list[torch.Tensor], Callable[[], object]]:
    rank, size = _rank_size()
    t, r = _ones(n, dtype), torch.zeros(n, dtype=dtype)

    def run() -> None:
        if size == 1:
            return  # gloo cannot send to itself
        ops = [
            dist.P2POp(dist.isend, t, (rank + 1) % size, group=g),
            dist.P2POp(dist.irecv, r, (rank - 1) % size, group=g),
        ]
        for request in dist.batch_isend_irecv(ops):
            request.wait()

    return [t, r], run


CASES: list[Case] = [
    _all_reduce,
    _all_reduce_async,
    _all_reduce_strided,
    _broadcast,
    _reduce,
    _all_gather,
    _all_gather_into_tensor,
    _reduce_scatter,
    _allreduce_coalesced,
    _gather,
    _scatter,
    _all_to_all,
    _send_recv,
    _batch_p2p,
]


def _left(
    group: dist.ProcessGroup, case: Case, dtype: torch.dtype, n: int
) -> list[tuple[int, bool]]:
    """(version bumps, storage resizable) of each of the case's tensors after it ran."""
    tensors, run = case(group, dtype, n)
    before = [t._version for t in tensors]
    run()
    return [
        (t._version - b, t.untyped_storage().resizable())
        for t, b in zip(tensors, before, strict=True)
    ]


def _fail_together(groups: dict[str, dist.ProcessGroup], problems: list[str]) -> None:
    """Asserts on every rank that no rank found a problem (one rank's failure fails all)."""
    every: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, problems, group=groups["gloo"])
    found = [f"rank {r}: {p}" for r, mine in enumerate(every) for p in mine or []]
    assert not found, "\n".join(found)


@pytest.mark.mpi
@pytest.mark.parametrize("n", [5, 70_000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_tensors_are_left_as_gloo_leaves_them(
    groups: dict[str, dist.ProcessGroup], dtype: torch.dtype, n: int
) -> None:
    """Storage still resizable and version counters as gloo's, after every operation."""
    problems = []
    for case in CASES:
        on_gloo = _left(groups["gloo"], case, dtype, n)
        on_mpx = _left(groups["mpx"], case, dtype, n)
        if on_mpx != on_gloo:
            problems.append(
                f"{case.__name__}: mpx left (bumps, resizable) {on_mpx}, gloo {on_gloo}"
            )
    _fail_together(groups, problems)


INFERENCE_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool,
                    torch.complex64]  # fmt: skip


def _inference_tensor(dtype: torch.dtype, n: int, rank: int) -> torch.Tensor:
    """Made under inference_mode, used after it: a tensor autograd refuses to write."""
    with torch.inference_mode():
        whole = torch.full((n,), rank + 1).to(dtype)
        pairs = torch.full((n, 2), rank + 1).to(dtype)
    return pairs[:, 0] if n > 5 else whole  # a strided view as well as a whole tensor


@pytest.mark.mpi
@pytest.mark.parametrize("n", [5, 70_000])
def test_an_inference_tensor_is_reduced_as_gloo_reduces_it(
    groups: dict[str, dist.ProcessGroup], n: int
) -> None:
    """gloo's SUM writes through raw pointers; mpx's 16-bit, narrow-int, bool and complex
    forms wrote back with torch: "Inplace update to inference tensor outside InferenceMode"."""
    rank, size = _rank_size()
    problems = []
    for dtype in INFERENCE_DTYPES:
        expected = {
            "sum": torch.full((n,), size * (size + 1) // 2).to(dtype),
            "avg": torch.full((n,), (size + 1) / 2).to(dtype),
        }
        for op in ("sum", "avg"):
            if op == "avg" and not (dtype.is_floating_point or dtype.is_complex):
                continue
            reduce_op = dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG
            # gloo's AVG raises here, and on a strided view gloo reduces the first n
            # elements of the storage instead of the view's: mpx against the value then.
            names = ("mpx", "gloo") if op == "sum" and n <= 5 else ("mpx",)
            for name in names:
                t = _inference_tensor(dtype, n, rank)
                try:
                    dist.all_reduce(t, op=reduce_op, group=groups[name])
                except RuntimeError as exc:
                    problems.append(f"{name} {op} {dtype}: {str(exc)[:80]}")
                    continue
                if not torch.equal(t, expected[op]):
                    problems.append(f"{name} {op} {dtype}: {t[:3].tolist()} != {expected[op][:3]}")
    _fail_together(groups, problems)


@pytest.mark.mpi
def test_tensors_can_be_resized_after_mpx_operations(groups: dict[str, dist.ProcessGroup]) -> None:
    """The symptom: ``t.resize_`` raised "Trying to resize storage that is not resizable"."""
    problems = []
    for case in CASES:
        tensors, run = case(groups["mpx"], torch.float32, 16)
        run()
        for i, t in enumerate(tensors):
            try:
                t.resize_(64)
            except RuntimeError as error:
                problems.append(f"{case.__name__}, tensor {i}: {error}")
    # And an AVG (gloo has none to compare with) leaves its tensor as a SUM does.
    t = _ones(1000, torch.bfloat16)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    if t._version != 0:
        problems.append(f"all_reduce AVG of bfloat16 bumped the version to {t._version}")
    t.resize_(2000)
    # Inference tensors have no version counter (t._version raises): the operations
    # that write them where they lie take them all the same.
    with torch.inference_mode():
        for case in (_all_reduce, _all_reduce_async, _reduce, _send_recv):
            tensors, run = case(groups["mpx"], torch.float32, 16)
            run()
    _fail_together(groups, problems)


def _structure(value: object) -> object:
    """A future's value as nested lists of (shape, values)."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), value.tolist())
    if isinstance(value, list):
        return [_structure(v) for v in value]
    return repr(value)


def _pointers(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    return [_pointers(v) for v in value] if isinstance(value, list) else value


@pytest.mark.mpi
def test_allgather_future_holds_one_list_per_input_as_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """c10d's allgather of k inputs: the value is outputs[0] for k = 1, else the k lists.

    mpx's was the k lists flattened (2 k * size tensors); torch's test_c10d_gloo
    reads it as gloo's.
    """
    rank, size = _rank_size()
    for k in (1, 2, 3):
        values: dict[str, object] = {}
        given: dict[str, object] = {}
        for name, group in groups.items():
            inputs = [torch.full((2,), 10.0 * rank + j) for j in range(k)]
            outputs = [[torch.zeros(2) for _ in range(size * k)] for _ in range(k)]
            work = group.allgather(outputs, inputs)
            work.wait()
            values[name] = work.get_future().value()
            given[name] = outputs[0] if k == 1 else outputs
            assert _structure(values[name]) == _structure(given[name]), (name, k)
        assert _structure(values["mpx"]) == _structure(values["gloo"]), k
        # The caller's own output tensors, not copies.
        assert _pointers(values["mpx"]) == _pointers(given["mpx"]), k


@pytest.mark.mpi
def test_allgather_coalesced_future_holds_one_list_per_rank_as_gloo(
    groups: dict[str, dist.ProcessGroup],
) -> None:
    """The value is one list per rank (the one list itself at one rank)."""
    rank, size = _rank_size()
    values: dict[str, object] = {}
    for name, group in groups.items():
        inputs = [torch.full((2,), float(rank)), torch.full((3,), -float(rank))]
        outputs = [[torch.zeros(2), torch.zeros(3)] for _ in range(size)]
        work = group.allgather_coalesced(outputs, inputs)
        work.wait()
        values[name] = work.get_future().value()
        given = outputs[0] if size == 1 else outputs
        assert _structure(values[name]) == _structure(given), name
    assert _structure(values["mpx"]) == _structure(values["gloo"])


def test_numpy_view_shares_memory_and_leaves_the_tensor_as_it_was() -> None:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()  # strided
    view = numpy_view(t)
    assert view.shape == (4, 3)
    assert view.dtype == np.float32
    assert view.tolist() == t.tolist()
    view[1, 2] = -5.0  # the tensor's memory
    assert t[1, 2].item() == -5.0
    assert t.untyped_storage().resizable()
    assert t._version == 0
    b = torch.ones(3, dtype=torch.bfloat16)
    assert numpy_view(b).dtype == np.int16  # the bits, as MPI moves them
    assert numpy_view(torch.empty(0)).shape == (0,)
    # The array keeps the tensor's memory alive, as t.numpy()'s does: its base
    # holds a tensor on that memory, which goes when the array goes.
    owner = torch.full((1000,), 3.0)
    address = owner.data_ptr()
    kept = numpy_view(owner)
    del owner
    gc.collect()
    holder = weakref.ref(kept.base.tensor)  # type: ignore[union-attr]
    assert holder() is not None
    assert holder().data_ptr() == address  # type: ignore[union-attr]
    assert float(kept.sum()) == 3000.0
    del kept
    gc.collect()
    assert holder() is None
