"""mpx-quantize's errors derive from MPXError; bad arguments are ValueError/TypeError too."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import mpx.quantize
from mpx.launch.errors import MPXError
from mpx.quantize import (
    CompressionConfig,
    QuantizeError,
    QuantizeTypeError,
    QuantizeValueError,
    dequantize,
    quantize,
)


def test_every_public_error_derives_from_the_package_base() -> None:
    found = [getattr(mpx.quantize, name) for name in mpx.quantize.__all__]
    errors = {x for x in found if isinstance(x, type) and issubclass(x, BaseException)}
    assert errors == {QuantizeError, QuantizeTypeError, QuantizeValueError}
    assert all(issubclass(e, QuantizeError) for e in errors)
    assert issubclass(QuantizeValueError, ValueError)
    assert issubclass(QuantizeTypeError, TypeError)


def test_the_base_is_the_one_mpx_error() -> None:
    assert issubclass(QuantizeError, MPXError)
    collectives = pytest.importorskip("mpx.collectives")
    assert collectives.MPXError is MPXError  # one root, re-exported


def test_imports_without_collectives() -> None:
    # mpx-collectives is an optional extra: without it the kernels and their
    # errors still import, and the errors are still MPXErrors (from mpx-launch).
    code = (
        "import sys; sys.modules['mpx.collectives'] = None\n"
        "import torch, mpx.quantize as q\n"
        "from mpx.launch.errors import MPXError\n"
        "assert q.QuantizeError.__bases__ == (MPXError,), q.QuantizeError.__mro__\n"
        "try: q.quantize(torch.zeros(8), bits=16)\n"
        "except ValueError as e: assert isinstance(e, q.QuantizeValueError)\n"
        "assert 'mpi4py' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize(
    ("call", "kind", "text"),
    [
        (lambda: quantize(torch.zeros(8), bits=16), QuantizeValueError, "bits=16"),
        (lambda: quantize(torch.zeros(8), bucket_size=0), QuantizeValueError, "bucket_size=0"),
        (lambda: quantize(torch.arange(10)), QuantizeTypeError, "torch.int64"),
        (lambda: quantize([1.0]), QuantizeTypeError, "list"),  # type: ignore[arg-type]
        (lambda: dequantize(torch.zeros(3)), QuantizeTypeError, "Tensor"),  # type: ignore[arg-type]
        (lambda: CompressionConfig(fusion_buffer_mb=0), QuantizeValueError, "fusion_buffer_mb=0"),
    ],
    ids=["bits", "bucket", "int-dtype", "not-tensor", "not-quantized", "config"],
)
def test_bad_arguments_raise_the_package_class_naming_the_value(
    call: object, kind: type[QuantizeError], text: str
) -> None:
    assert callable(call)
    with pytest.raises(kind) as info:
        call()
    builtin = ValueError if kind is QuantizeValueError else TypeError
    assert {QuantizeError, builtin} <= set(type(info.value).__mro__)
    assert text in str(info.value)
