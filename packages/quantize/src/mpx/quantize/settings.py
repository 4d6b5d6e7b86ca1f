"""mpx-quantize's environment variables, declared once (the table is mpx-launch's).

CGX's names are aliases: an ``MPX_QUANTIZE_*`` variable wins over its CGX
name when both are set. The accepted values are declared here (bits as a
choice, sizes with their minimum), so ``mpxrun --settings`` reports a value out
of range (``CGX_COMPRESSION_QUANTIZATION_BITS=40``) as the program would.
:meth:`mpx.quantize.CompressionConfig.from_env` reads them; ``mpxrun --settings``
lists them with every other package's.
"""

from __future__ import annotations

from typing import Any

from mpx.launch.settings import Setting, declare

__all__ = ["BITS_CHOICES", "BUILD_CUDA", "CONFIG"]

_PACKAGE = "quantize"

BITS_CHOICES = (*(str(b) for b in range(1, 9)), "32")

# CompressionConfig field -> its variable (the defaults are the dataclass's own).
CONFIG: dict[str, Setting[Any]] = {
    # A choice (parsed as text; CompressionConfig.from_env makes it an int): the
    # settings check then refuses 0, 9-31 and 40 as the program does.
    "bits": declare(
        "MPX_QUANTIZE_BITS",
        "choice",
        "4",
        "bits per value, 1-8 (32: no compression; the cgx backend's default)",
        package=_PACKAGE,
        choices=BITS_CHOICES,
        aliases=("CGX_COMPRESSION_QUANTIZATION_BITS",),
    ),
    "bucket_size": declare(
        "MPX_QUANTIZE_BUCKET_SIZE",
        "int",
        512,
        "values per bucket sharing one min and unit",
        package=_PACKAGE,
        minimum=1,
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
        minimum=0,
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
    # CGX reads CGX_INNER_COMMUNICATOR_TYPE (MPI, SHM or NCCL); the other two
    # names are mpx's earlier spellings. NCCL is refused: no CPU transport.
    "communicator": declare(
        "MPX_QUANTIZE_COMMUNICATOR",
        "choice",
        "auto",
        "transport of the compressed allreduce: auto, mpi or shm (CGX's MPI/SHM; NCCL is refused)",
        package=_PACKAGE,
        choices=("auto", "mpi", "shm", "AUTO", "MPI", "SHM"),
        aliases=("CGX_INNER_COMMUNICATOR_TYPE", "CGX_COMMUNICATOR_TYPE", "COMMUNICATOR_TYPE"),
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
