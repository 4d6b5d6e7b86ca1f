"""mpx.collectives.building_blocks: the public API of mpx-collectives for upper layers."""

from __future__ import annotations

import pytest
import torch

from mpx.collectives import building_blocks
from mpx.collectives.building_blocks import (
    HEADER_LEN,
    SUPPORTED_DTYPES,
    decode_header,
    encode_header,
    progress_thread_enabled,
    small_bytes,
    usable_cores,
)
from mpx.launch.settings import reload as reload_settings


def test_everything_it_lists_is_there_and_documented() -> None:
    doc = building_blocks.__doc__ or ""
    for name in building_blocks.__all__:
        assert hasattr(building_blocks, name), name
        assert name in doc, f"{name} is exported but not in the module's table"


@pytest.mark.parametrize("shape", [(), (7,), (2, 3, 4), (1,) * 8])
@pytest.mark.parametrize("dtype", SUPPORTED_DTYPES)
def test_header_round_trip(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    header = encode_header(torch.Size(shape), dtype)
    assert header.shape == (HEADER_LEN,)
    assert header.dtype == torch.int64
    assert decode_header(header) == (torch.Size(shape), dtype)


def test_header_refuses_what_cannot_travel() -> None:
    with pytest.raises(ValueError, match="more than 8 dimensions"):
        encode_header(torch.Size((1,) * 9), torch.float32)
    with pytest.raises(TypeError, match="complex64"):
        encode_header(torch.Size((2,)), torch.complex64)


def test_machine_facts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert usable_cores() >= 1
    assert small_bytes() > 0
    monkeypatch.setenv("MPX_PROGRESS_THREAD", "0")
    reload_settings()  # settings are read once: an earlier test in this process read it
    assert progress_thread_enabled() is False
