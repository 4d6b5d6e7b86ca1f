"""The operations are generated from the table of op specs, and their API is unchanged.

``ops.py``'s operations (signatures, overloads, bodies) are rendered from
``op_specs.OP_SPECS`` by ``mpx.collectives.core.ops_source``. Checked here: the
section in ``ops.py`` is what the table renders; every op keeps its public
parameters, defaults and result types (this file is type-checked by mypy:
each ``assert_type`` below is a promise to strict mypy users, checked
statically, and once more when it runs).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from typing_extensions import assert_type

import mpx.collectives
from mpx.collectives import (
    Handle,
    allgather,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    recv,
    reduce,
    reduce_scatter,
    send,
    world,
)
from mpx.collectives.core import ops, ops_source
from mpx.collectives.core.op_specs import OP_SPECS, OpSpec

# The public API before the ops were generated (0.1.0): name -> the parameters
# (name, kind, default) after which comm/impl/async_op/timeout follow.
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_EMPTY = inspect.Parameter.empty
_API: dict[str, tuple[tuple[str, object], ...]] = {
    "allreduce": (("t", _EMPTY), ("op", "sum")),
    "broadcast": (("t", _EMPTY), ("root", 0)),
    "reduce": (("t", _EMPTY), ("root", 0), ("op", "sum")),
    "allgather": (("t", _EMPTY),),
    "reduce_scatter": (("t", _EMPTY), ("op", "sum")),
    "alltoall": (("t", _EMPTY),),
    "send": (("t", _EMPTY), ("dest", _EMPTY), ("tag", 0)),
    "recv": (("t", _EMPTY), ("source", _EMPTY), ("tag", 0)),
    "barrier": (),
}
_WITHOUT_IMPL = {"send", "recv", "barrier"}


def test_the_generated_section_is_what_the_table_renders() -> None:
    """Fails after a change to OP_SPECS or the template until ops.py is regenerated."""
    source = Path(str(ops.__file__)).read_text()
    assert ops_source.normalized(ops_source.section(source)) == ops_source.normalized(
        ops_source.render()
    ), "run: python -m mpx.collectives.core.ops_source && ruff format ops.py"


def test_a_new_spec_renders_an_operation_of_its_own() -> None:
    spec = OpSpec("scatter", "scatter", rooted=True, params=(("root", "int", "0"),), doc="One.")
    text = ops_source.render({"scatter": spec})
    assert text.count("@overload") == 3  # blocking, async_op=True, async_op: bool
    assert "_call(_PLANS['scatter'], comm, impl, async_op, timeout, t, root)" in text
    defined: dict[str, object] = {"overload": lambda f: f}
    exec(compile("from __future__ import annotations\n" + text, "<rendered>", "exec"), defined)
    parameters = inspect.signature(defined["scatter"]).parameters  # type: ignore[arg-type]
    assert list(parameters) == ["t", "root", "comm", "impl", "async_op", "timeout"]


def test_every_operation_keeps_its_public_parameters() -> None:
    assert set(_API) == set(OP_SPECS)
    for name, own in _API.items():
        function = getattr(mpx.collectives, name)
        assert function.__module__ == "mpx.collectives.core.ops"
        assert inspect.getdoc(function) == inspect.cleandoc(OP_SPECS[name].doc)
        params = list(inspect.signature(function).parameters.values())
        common = [("comm", None), ("async_op", False), ("timeout", None)]
        if name not in _WITHOUT_IMPL:
            common.insert(1, ("impl", None))
        expected = [(n, _POSITIONAL, d) for n, d in own] + [
            (n, inspect.Parameter.KEYWORD_ONLY, d) for n, d in common
        ]
        assert [(p.name, p.kind, p.default) for p in params] == expected, name


def test_every_operation_types_its_result() -> None:
    """Strict mypy sees each op's result type from async_op (and a Python number's type)."""
    comm = world()
    size = comm.size
    t = torch.ones(size * 2)
    assert assert_type(allreduce(t), torch.Tensor) is t
    assert assert_type(allreduce(t, "max", async_op=True), Handle[torch.Tensor]).wait(60) is t
    assert assert_type(allreduce(3), int) == 3 * size
    assert assert_type(allreduce(0.5, op="sum"), float) == 0.5 * size
    assert assert_type(broadcast(t, 0), torch.Tensor) is t
    assert assert_type(broadcast(t, root=0, async_op=True), Handle[torch.Tensor]).wait(60) is t
    assert assert_type(broadcast(7, 0), int) == 7
    assert assert_type(reduce(t, 0, "sum"), torch.Tensor) is t
    assert assert_type(reduce(t, async_op=True), Handle[torch.Tensor]).wait(60) is t
    assert assert_type(allgather(t), torch.Tensor).shape == (size, size * 2)
    gathered = assert_type(allgather(t, async_op=True), Handle[torch.Tensor]).wait(60)
    assert gathered.shape == (size, size * 2)
    assert assert_type(reduce_scatter(t), torch.Tensor).shape == (2,)
    scattered = assert_type(reduce_scatter(t, op="max", async_op=True), Handle[torch.Tensor])
    assert scattered.wait(60).shape == (2,)
    assert assert_type(alltoall(t), torch.Tensor).shape == t.shape
    assert assert_type(alltoall(t, async_op=True), Handle[torch.Tensor]).wait(60).shape == t.shape
    either = assert_type(allreduce(t, async_op=size > 0), torch.Tensor | Handle[torch.Tensor])
    assert isinstance(either, Handle)
    either.wait(60)
    # Point to point with this rank itself: the send must not block the receive.
    sent = assert_type(send(t, comm.rank, tag=5, async_op=True), Handle[None])
    into = torch.zeros_like(t)
    assert assert_type(recv(into, comm.rank, tag=5), torch.Tensor) is into
    assert sent.wait(60) is None
    received = assert_type(recv(into, source=comm.rank, async_op=True), Handle[torch.Tensor])
    assert assert_type(send(t, dest=comm.rank), None) is None
    assert received.wait(60) is into
    assert assert_type(barrier(), None) is None
    assert assert_type(barrier(async_op=True), Handle[None]).wait(60) is None
    maybe = assert_type(barrier(async_op=size < 0), Handle[None] | None)
    assert maybe is None
