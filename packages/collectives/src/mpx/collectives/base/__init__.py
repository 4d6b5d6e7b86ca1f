"""What every layer of mpx-collectives stands on: the errors, the dtypes and
the checks of arguments, the steps model (handles, the queue, the progress
thread that drives them), small byte exchanges, element-wise reductions in
torch, and torch's private APIs (``_torch_private``: the one module that uses
them).

May import: nothing of mpx-collectives but the top-level ``settings``.
"""

from mpx.collectives.base._torch_private import (
    export_cuda_storage,
    gloo_process_group,
    on_builtin_comm_hook,
    open_cuda_storage,
    set_versions,
)
from mpx.collectives.base.checks import as_limit, check_rank, check_tensor, check_timeout
from mpx.collectives.base.dtypes import (
    REDUCE_OPS,
    SUPPORTED_DTYPES,
    accumulation_dtype,
    check_op_for_dtype,
    mpi_reduces,
    numpy_view,
    wire_view,
)
from mpx.collectives.base.errors import (
    CollectiveTimeout,
    CommunicatorBroken,
    MismatchError,
    MPXError,
    MPXTypeError,
    MPXValueError,
    RemoteError,
)
from mpx.collectives.base.exchange import gather_bytes, summarize
from mpx.collectives.base.handle import (
    LOCK,
    Backoff,
    Done,
    Handle,
    Pending,
    Queue,
    Requests,
    Steps,
    drive,
    wait_yielding,
)
from mpx.collectives.base.reduction import combine, finish, reduce_into, working_copy, writable

__all__ = [
    "LOCK",
    "REDUCE_OPS",
    "SUPPORTED_DTYPES",
    "Backoff",
    "CollectiveTimeout",
    "CommunicatorBroken",
    "Done",
    "Handle",
    "MPXError",
    "MPXTypeError",
    "MPXValueError",
    "MismatchError",
    "Pending",
    "Queue",
    "RemoteError",
    "Requests",
    "Steps",
    "accumulation_dtype",
    "as_limit",
    "check_op_for_dtype",
    "check_rank",
    "check_tensor",
    "check_timeout",
    "combine",
    "drive",
    "export_cuda_storage",
    "finish",
    "gather_bytes",
    "gloo_process_group",
    "mpi_reduces",
    "numpy_view",
    "on_builtin_comm_hook",
    "open_cuda_storage",
    "reduce_into",
    "set_versions",
    "summarize",
    "wait_yielding",
    "wire_view",
    "working_copy",
    "writable",
]
