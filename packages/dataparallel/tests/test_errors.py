"""mpx-dataparallel's errors derive from MPXError; bad arguments are ValueError/TypeError too."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

import mpx.dataparallel as dp
from mpx.collectives import MismatchError, MPXError, RemoteError
from mpx.dataparallel import (
    DataParallelError,
    DataParallelRemoteError,
    DataParallelTypeError,
    DataParallelValueError,
    ParameterServerError,
)


def test_every_public_error_derives_from_mpx_error() -> None:
    found = [getattr(dp, name) for name in dp.__all__]
    errors = {x for x in found if isinstance(x, type) and issubclass(x, Exception)}
    # Not an error: a restarted group with nothing left to train ends with exit code 0.
    exits = {x for x in found if isinstance(x, type) and issubclass(x, BaseException)} - errors
    assert exits == {dp.TrainingFinished}
    assert issubclass(dp.TrainingFinished, SystemExit)
    assert dp.TrainingFinished(7).code == 0
    assert dp.TrainingFinished(7).step == 7
    assert errors == {
        DataParallelError,
        dp.DataParallelMismatchError,
        DataParallelRemoteError,
        DataParallelTypeError,
        DataParallelValueError,
        ParameterServerError,
    }
    assert all(issubclass(e, DataParallelError) and issubclass(e, MPXError) for e in errors)
    assert issubclass(DataParallelValueError, ValueError)
    assert issubclass(DataParallelTypeError, TypeError)
    assert not issubclass(DataParallelError, (ValueError, TypeError))
    # Raised on every rank when some failed: a RemoteError, no argument error.
    assert issubclass(DataParallelRemoteError, RemoteError)
    assert not issubclass(DataParallelRemoteError, (ValueError, TypeError))
    # Models that differ across ranks: a MismatchError of collectives' kind.
    assert issubclass(dp.DataParallelMismatchError, MismatchError)


def _container(data: Any, **kwargs: Any) -> dp.DistributedDataContainer:
    one = SimpleNamespace(rank=0, size=1)  # no MPI needed: a stand-in communicator
    return dp.DistributedDataContainer(data, comm=one, **kwargs)  # type: ignore[arg-type]


def _adam() -> torch.optim.Optimizer:
    return torch.optim.Adam(nn.Linear(2, 2).parameters())


CASES = [
    pytest.param(lambda: _container(range(4), uneven="even"), DataParallelValueError, "'even'"),
    pytest.param(lambda: _container(range(4), seed=1.5), DataParallelTypeError, "float"),
    pytest.param(lambda: _container(5), DataParallelTypeError, "int"),
    pytest.param(lambda: _container(range(4)).set_epoch(-1), DataParallelValueError, "-1"),
    pytest.param(
        lambda: dp.DistributedOptimizer(nn.Linear(2, 2)),  # type: ignore[arg-type]
        DataParallelTypeError,
        "Linear",
    ),
    pytest.param(
        lambda: dp.DistributedOptimizer(_adam(), bucket_mb=0), DataParallelValueError, "got 0"
    ),
    pytest.param(
        lambda: dp.EASGD([nn.Parameter(torch.zeros(2))], object(), lr=0.1),  # type: ignore[arg-type]
        DataParallelTypeError,
        "got object",
    ),
    pytest.param(lambda: dp.synchronize(nn.Linear(2, 2), 7), DataParallelValueError, "got 7"),
    pytest.param(
        lambda: dp.save_checkpoint(Path("unused.pt"), object()),  # type: ignore[arg-type]
        DataParallelTypeError,
        "got object",
    ),
]


@pytest.mark.parametrize(("call", "kind", "text"), CASES)
def test_bad_arguments_raise_the_package_class_naming_the_value(
    call: Callable[[], object], kind: type[DataParallelError], text: str
) -> None:
    with pytest.raises(kind) as info:
        call()
    builtin = ValueError if kind is DataParallelValueError else TypeError
    assert {MPXError, DataParallelError, builtin} <= set(type(info.value).__mro__)
    assert text in str(info.value)
