"""``mpx.quantize.torch_backend``, the ``"cgx"`` torch.distributed backend: the
module :mod:`mpx.quantize.cgx.torch_backend`.

The module lives in ``cgx/`` (issue 57: CGX compatibility, marked as such).
This path stays because users import it by it (the README's API table:
``register_torch_backend()``). Importing it imports mpx-collectives, and with
it MPI. ``sys.modules`` maps this name to that module itself:
``mpx.quantize.torch_backend`` *is* ``mpx.quantize.cgx.torch_backend``.
The names bound below only tell type checkers what the module holds.
"""

import sys

from mpx.quantize.cgx import torch_backend

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "register_torch_backend"]

BACKEND_NAME = torch_backend.BACKEND_NAME
CGXProcessGroup = torch_backend.CGXProcessGroup
register_torch_backend = torch_backend.register_torch_backend

sys.modules[__name__] = torch_backend
