"""mpx-mgrit's errors derive from MPXError; bad arguments are ValueError/TypeError too."""

from __future__ import annotations

import pytest
import torch
from mpi4py import MPI

import mpx.mgrit
from mpx.collectives import Communicator, MPXError
from mpx.mgrit import MGRIT, MGRITConfigError, MGRITError, MGRITTypeError


def decay(u: torch.Tensor, t: float, dt: float) -> torch.Tensor:
    return u / (1 + dt)


def self_comm() -> Communicator:
    return Communicator.from_mpi(MPI.COMM_SELF)


def test_every_public_error_derives_from_mpx_error() -> None:
    found = [getattr(mpx.mgrit, name) for name in mpx.mgrit.__all__]
    errors = {x for x in found if isinstance(x, type) and issubclass(x, BaseException)}
    assert errors == {MGRITError, MGRITConfigError, MGRITTypeError}
    assert all(issubclass(e, MGRITError) and issubclass(e, MPXError) for e in errors)
    assert issubclass(MGRITConfigError, ValueError)
    # A TypeError now, and still the MGRITConfigError (a ValueError) it was before.
    assert issubclass(MGRITTypeError, TypeError)
    assert issubclass(MGRITTypeError, MGRITConfigError)
    assert not issubclass(MGRITError, ValueError)


def test_a_bad_value_is_a_value_error_naming_it() -> None:
    with pytest.raises(ValueError, match="cfactor=1") as info:
        MGRIT(decay, 0.0, 1.0, nt=64, cfactor=1, comm=self_comm())
    assert isinstance(info.value, MGRITConfigError)
    assert "use cfactor=2 or more" in str(info.value)


def test_a_step_that_is_not_callable_is_a_type_error_naming_it() -> None:
    with pytest.raises(TypeError, match="step must be callable") as info:
        MGRIT("decay", 0.0, 1.0, nt=64, comm=self_comm())  # type: ignore[arg-type]
    assert isinstance(info.value, MGRITTypeError)
    assert isinstance(info.value, ValueError)
    assert "'decay'" in str(info.value)


def test_a_state_that_is_no_tensor_is_a_type_error_naming_it() -> None:
    solver = MGRIT(decay, 0.0, 1.0, nt=8, comm=self_comm())
    with pytest.raises(MGRITTypeError, match=r"u0 must be a torch\.Tensor, got list") as info:
        solver.solve([1.0])  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError)
    assert "torch.as_tensor" in str(info.value)
