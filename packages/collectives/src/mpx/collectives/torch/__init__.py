"""The ``mpx`` torch.distributed backend: the process group (``process_group``,
``group``), its works and futures, the forms torch hands collectives in, the
eager mode under ``torch.compile``, and ``init_process_group`` (``backend``).
``mpx._collectives_autoload``, beside the package, registers it at
``import torch``.

May import: ``core``, ``node``, ``base``.
"""

from mpx.collectives.torch.backend import (
    MPXProcessGroup,
    MPXWork,
    init_process_group,
    register_torch_backend,
)

__all__ = ["MPXProcessGroup", "MPXWork", "init_process_group", "register_torch_backend"]
