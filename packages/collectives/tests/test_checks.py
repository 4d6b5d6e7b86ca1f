"""Bad input is refused before any communication, with the fix in the message."""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import allgather, allreduce, broadcast, send
from mpx.collectives.base.checks import check_tensor
from mpx.launch.settings import reload as reload_settings


def test_not_a_tensor() -> None:
    with pytest.raises(TypeError, match=r"must be a torch\.Tensor, got list"):
        check_tensor([1, 2], "allreduce")


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int16, torch.bool, torch.float8_e4m3fn])
def test_unsupported_dtype_names_it_and_the_fix(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"dtype {dtype} is not supported.*to\(torch.float32\)"):
        allreduce(torch.zeros(3, dtype=dtype))


def test_non_contiguous_names_shape_and_fix() -> None:
    with pytest.raises(ValueError, match=r"shape \(3, 4\) is not contiguous.*contiguous\(\)"):
        allgather(torch.zeros(4, 3).t())


def test_bad_op_root_impl() -> None:
    with pytest.raises(ValueError, match=r"op must be one of sum, avg, max, min, prod, got 'mean'"):
        allreduce(torch.zeros(3), "mean")
    with pytest.raises(ValueError, match=r"root must be a rank in \[0, 1\), got 5"):
        broadcast(torch.zeros(3), 5)
    with pytest.raises(
        ValueError,
        match=r"impl must be 'auto' or one of mpi, ring, shm, hier, staged, ipc, gloo, nccl"
        r".*, got 'fast'",
    ):
        allreduce(torch.zeros(3), impl="fast")
    with pytest.raises(ValueError, match=r"dest must be a rank in \[0, 1\), got -1"):
        send(torch.zeros(3), -1)


def test_bad_environment_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MPX_COLLECTIVES_IMPL", "fast")
    reload_settings()
    with pytest.raises(ValueError, match="MPX_COLLECTIVES_IMPL"):
        allreduce(torch.zeros(3))


def test_single_process_is_a_world_of_one() -> None:
    t = torch.arange(5.0)
    assert allreduce(t, "avg") is t
    assert torch.equal(t, torch.arange(5.0))
    assert allgather(t).shape == (1, 5)
