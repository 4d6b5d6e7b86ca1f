"""mpx-quantize's environment variables, declared once (the table is mpx-launch's).

CGX's names are aliases: an ``MPX_QUANTIZE_*`` variable wins over its CGX
name when both are set. :meth:`mpx.quantize.CompressionConfig.from_env`
reads them; ``mpxrun --settings`` lists them with every other package's.
"""

from __future__ import annotations

from typing import Any

from mpx.launch.settings import Setting, declare

__all__ = ["BUILD_CUDA", "CONFIG"]

_PACKAGE = "quantize"

# CompressionConfig field -> its variable (the defaults are the dataclass's own).
CONFIG: dict[str, Setting[Any]] = {
    "bits": declare(
        "MPX_QUANTIZE_BITS",
        "int",
        4,
        "bits per value, 1-8 (32: no compression)",
        package=_PACKAGE,
        aliases=("CGX_COMPRESSION_QUANTIZATION_BITS",),
    ),
    "bucket_size": declare(
        "MPX_QUANTIZE_BUCKET_SIZE",
        "int",
        512,
        "values per bucket sharing one min and unit",
        package=_PACKAGE,
        aliases=("CGX_COMPRESSION_BUCKET_SIZE",),
    ),
    "skip_incomplete_buckets": declare(
        "MPX_QUANTIZE_SKIP_INCOMPLETE_BUCKETS",
        "bool",
        False,
        "leave a tensor's last, partial bucket uncompressed",
        package=_PACKAGE,
        aliases=("CGX_COMPRESSION_SKIP_INCOMPLETE_BUCKETS",),
    ),
    "minimal_size": declare(
        "MPX_QUANTIZE_MINIMAL_SIZE",
        "int",
        16,
        "tensors with fewer elements go uncompressed",
        package=_PACKAGE,
        aliases=("CGX_COMPRESSION_MINIMAL_SIZE",),
    ),
    "fusion_buffer_mb": declare(
        "MPX_QUANTIZE_FUSION_BUFFER_MB",
        "float",
        64.0,
        "MiB of small tensors fused into one buffer before compression",
        package=_PACKAGE,
        unit="MiB",
        aliases=("CGX_FUSION_BUFFER_SIZE_MB",),
    ),
    "error_feedback": declare(
        "MPX_QUANTIZE_ERROR_FEEDBACK",
        "bool",
        False,
        "add each step's quantization error to the next step's gradient",
        package=_PACKAGE,
    ),
    "exclude": declare(
        "MPX_QUANTIZE_EXCLUDE",
        "str",
        "",
        "comma-separated parameter-name parts that stay uncompressed",
        package=_PACKAGE,
    ),
    "stochastic": declare(
        "MPX_QUANTIZE_STOCHASTIC",
        "bool",
        True,
        "stochastic (unbiased) rounding; 0 rounds to nearest",
        package=_PACKAGE,
    ),
    "communicator": declare(
        "MPX_QUANTIZE_COMMUNICATOR",
        "str",
        "auto",
        "transport of the compressed allreduce: auto, mpi or shm (CGX's MPI/SHM)",
        package=_PACKAGE,
        aliases=("CGX_COMMUNICATOR_TYPE", "COMMUNICATOR_TYPE"),
    ),
    "seed": declare(
        "MPX_QUANTIZE_SEED",
        "int",
        0,
        "seed of the stochastic rounding's generator",
        package=_PACKAGE,
    ),
}

BUILD_CUDA = declare(
    "MPX_QUANTIZE_CUDA",
    "choice",
    "AUTO",
    "build the CUDA kernels: AUTO (if nvcc is found), ON (required) or OFF",
    package=_PACKAGE,
    choices=("AUTO", "ON", "OFF"),
    when="build",
)
