"""mpx-pipeline's errors derive from MPXError; bad arguments are ValueError/TypeError too."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import mpx.pipeline
from mpx.collectives import MismatchError, MPXError, RemoteError
from mpx.pipeline import (
    PipelineError,
    PipelineMismatchError,
    PipelineRemoteError,
    PipelineTypeError,
    PipelineValueError,
)
from mpx.pipeline.model.partition import check_balance
from mpx.pipeline.runtime.transport import encode_header
from mpx.pipeline.schedules.table import simulate, stage_ops
from mpx.pipeline.staleness.prediction import predict


def test_every_public_error_derives_from_mpx_error() -> None:
    found = [getattr(mpx.pipeline, name) for name in mpx.pipeline.__all__]
    errors = {x for x in found if isinstance(x, type) and issubclass(x, BaseException)}
    assert errors == {
        PipelineError,
        PipelineMismatchError,
        PipelineRemoteError,
        PipelineTypeError,
        PipelineValueError,
    }
    assert all(issubclass(e, PipelineError) and issubclass(e, MPXError) for e in errors)
    assert issubclass(PipelineValueError, ValueError)
    # A TypeError now, and still the ValueError every PipelineError was before.
    assert issubclass(PipelineTypeError, TypeError)
    assert issubclass(PipelineTypeError, ValueError)
    assert not issubclass(PipelineError, ValueError)
    # Raised on every stage when one failed: a RemoteError, no argument error.
    assert issubclass(PipelineRemoteError, RemoteError)
    assert not issubclass(PipelineRemoteError, ValueError)
    # Ranks that built one pipeline differently: a bad argument, and a collectives mismatch.
    assert issubclass(PipelineMismatchError, PipelineValueError)
    assert issubclass(PipelineMismatchError, MismatchError)


def test_a_deadlock_is_no_argument_error() -> None:
    with pytest.raises(PipelineError, match="deadlock") as info:
        simulate([[("B", 0), ("F", 0)], [("F", 0), ("B", 0)]])
    assert not isinstance(info.value, ValueError)


def _sgd() -> torch.optim.Optimizer:
    return torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)


CASES = [
    pytest.param(lambda: stage_ops("zigzag", 0, 2, 2), PipelineValueError, "'zigzag'", id="name"),
    pytest.param(lambda: stage_ops("gpipe", 0, 2, 0), PipelineValueError, "chunks=0", id="chunks"),
    pytest.param(lambda: check_balance([2, 3], 6, 2), PipelineValueError, "sums to 5", id="sum"),
    pytest.param(
        lambda: encode_header(torch.Size((1,) * 9), torch.float32),
        PipelineValueError,
        "(1, 1, 1, 1, 1, 1, 1, 1, 1)",
        id="dims",
    ),
    pytest.param(
        lambda: encode_header(torch.Size((2,)), torch.complex64),
        PipelineTypeError,
        "complex64",
        id="dtype",
    ),
    pytest.param(
        lambda: predict(torch.optim.RMSprop([torch.nn.Parameter(torch.zeros(2))]), [], 1, "msnag"),
        PipelineTypeError,
        "RMSprop",
        id="optimizer",
    ),
    pytest.param(lambda: predict(_sgd(), [], 1, "nag"), PipelineValueError, "'nag'", id="mode"),
]


@pytest.mark.parametrize(("call", "kind", "text"), CASES)
def test_bad_arguments_raise_the_package_class_naming_the_value(
    call: Callable[[], object], kind: type[PipelineError], text: str
) -> None:
    with pytest.raises(kind) as info:
        call()
    mro = set(type(info.value).__mro__)
    assert {MPXError, PipelineError, ValueError} <= mro  # except ValueError still catches it
    if kind is PipelineTypeError:
        assert TypeError in mro
    assert text in str(info.value)
