"""One error taxonomy: every error derives from MPXError; bad arguments are builtins too."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

import mpx.collectives
from mpx.collectives import (
    CollectiveTimeout,
    CommunicatorBroken,
    MismatchError,
    MPXError,
    MPXTypeError,
    MPXValueError,
    RemoteError,
    allgather,
    allreduce,
    broadcast,
    empty_shared,
    world,
)
from mpx.collectives.base._torch_private import export_cuda_storage
from mpx.collectives.base.checks import check_tensor
from mpx.collectives.impl import hier as impl_hier
from mpx.collectives.impl import ipc as impl_ipc
from mpx.collectives.impl import staged as impl_staged
from mpx.collectives.torch.forms import reduce_form, reduce_op


def public_errors(module: ModuleType) -> list[type[BaseException]]:
    found = [getattr(module, name) for name in module.__all__]
    return [x for x in found if isinstance(x, type) and issubclass(x, BaseException)]


def test_every_public_error_derives_from_mpx_error() -> None:
    errors = public_errors(mpx.collectives)
    assert set(errors) == {
        CollectiveTimeout,
        CommunicatorBroken,
        MismatchError,
        MPXError,
        MPXTypeError,
        MPXValueError,
        RemoteError,
    }
    assert all(issubclass(e, MPXError) for e in errors)


def test_argument_errors_are_also_the_builtin_they_replace() -> None:
    assert issubclass(MPXValueError, ValueError)
    assert issubclass(MPXTypeError, TypeError)
    assert not issubclass(MPXValueError, TypeError)
    assert not issubclass(MPXTypeError, ValueError)
    assert issubclass(MismatchError, ValueError)
    assert issubclass(CollectiveTimeout, TimeoutError)
    assert not issubclass(RemoteError, (ValueError, TypeError))


def _tensor_on_meta() -> torch.Tensor:
    return torch.zeros(3, device="meta")


CASES = [
    pytest.param(lambda: allreduce(torch.zeros(3), "mean"), MPXValueError, "'mean'", id="op"),
    pytest.param(
        lambda: allreduce(torch.zeros(3, dtype=torch.int32), "avg"),
        MPXTypeError,
        "int32",
        id="avg-int",
    ),
    pytest.param(lambda: broadcast(torch.zeros(3), 5), MPXValueError, "got 5", id="root"),
    pytest.param(
        lambda: allreduce([1.0, 2.0]),  # type: ignore[call-overload]
        MPXTypeError,
        "got list",
        id="not-tensor",
    ),
    pytest.param(
        lambda: allreduce(torch.zeros(3, dtype=torch.complex64)),
        MPXTypeError,
        "complex64",
        id="dtype",
    ),
    pytest.param(lambda: allgather(torch.zeros(4, 3).t()), MPXValueError, "(3, 4)", id="strided"),
    pytest.param(
        lambda: check_tensor(_tensor_on_meta(), "allreduce"), MPXValueError, "meta", id="device"
    ),
    pytest.param(lambda: empty_shared((2, -1)), MPXValueError, "(2, -1)", id="shape"),
    pytest.param(
        lambda: impl_ipc._check(world(), torch.zeros(3), "allreduce"),
        MPXValueError,
        "cpu",
        id="ipc",
    ),
    pytest.param(
        lambda: impl_staged._check_cuda(torch.zeros(3), "allreduce"),
        MPXValueError,
        "cpu",
        id="staged",
    ),
    pytest.param(lambda: export_cuda_storage(torch.zeros(3)), MPXValueError, "cpu", id="cuda-ipc"),
    pytest.param(
        lambda: reduce_op(dist.ReduceOp.PREMUL_SUM, "allreduce"),
        MPXValueError,
        "allreduce: ReduceOp.PREMUL_SUM is not supported by the mpx backend",
        id="torch-op",
    ),
    pytest.param(
        lambda: reduce_form(torch.ones(2), "bxor", "allreduce"),
        MPXTypeError,
        "allreduce: BXOR needs an integer or bool tensor",
        id="torch-bitwise-float",
    ),
]


@pytest.mark.parametrize(("call", "kind", "text"), CASES)
def test_bad_arguments_raise_the_package_class_naming_the_value(
    call: Callable[[], object], kind: type[MPXError], text: str
) -> None:
    with pytest.raises(kind) as info:
        call()
    builtin = ValueError if kind is MPXValueError else TypeError
    assert {MPXError, builtin} <= set(type(info.value).__mro__)  # except clauses of both catch it
    assert text in str(info.value)


def test_hier_on_one_node_is_a_value_error() -> None:
    comm = world()
    if comm.hierarchy is not None:
        pytest.skip("this communicator spans several nodes: impl='hier' is allowed")
    with pytest.raises(MPXValueError, match="impl='hier'") as info:
        impl_hier._hierarchy(comm, "allreduce")
    assert isinstance(info.value, ValueError)
    assert f"{comm.num_nodes} node(s)" in str(info.value)
