from typing import Any

def build_info() -> dict[str, Any]: ...
def device_count() -> int: ...
def quantize(
    x: int,
    dtype: int,
    count: int,
    bits: int,
    bucket_size: int,
    stochastic: bool,
    seed: int,
    mins: int,
    units: int,
    values: int,
    device: int,
    stream: int,
) -> None: ...
def dequantize(
    values: int,
    mins: int,
    units: int,
    qdtype: int,
    count: int,
    bits: int,
    bucket_size: int,
    out: int,
    out_dtype: int,
    accumulate: bool,
    device: int,
    stream: int,
) -> None: ...
