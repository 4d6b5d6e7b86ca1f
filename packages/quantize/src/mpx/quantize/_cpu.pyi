from typing import Any

def build_info() -> dict[str, Any]: ...
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
    threads: int,
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
    threads: int,
) -> None: ...
