"""The compiled backends: the CPU one always, the CUDA one where built."""

from __future__ import annotations

import pytest

import mpx.quantize as q


def test_cpu_extension_is_always_built() -> None:
    assert q.available_backends()[0] == "cpu"
    info = q.build_info()["cpu"]
    assert info["backend"] == "cpu"
    assert info["hardware_threads"] >= 1


def test_cuda_backend_is_listed_only_when_usable() -> None:
    built = q.available_backends()
    usable = q.available_backends(usable_only=True)
    assert set(usable) <= set(built)
    if "cuda" in built:
        from mpx.quantize import _cuda

        assert q.build_info()["cuda"]["cuda_runtime_version"] >= 12000
        assert ("cuda" in usable) == (_cuda.device_count() > 0)


@pytest.mark.gpu
def test_cuda_extension_sees_the_gpu() -> None:
    import torch

    assert "cuda" in q.available_backends(usable_only=True)
    from mpx.quantize import _cuda

    assert _cuda.device_count() == torch.cuda.device_count()
