"""``mpx.quantize.compression_choice``, how ``when="auto"`` decides: the module
:mod:`mpx.quantize.reduction.compression_choice`.

The module lives in ``reduction/`` (issue 57: one subpackage a role). This
path stays because users import it by it (the README's API table) and set
``MARGIN`` on it, which must reach the module :func:`choose` reads:
``sys.modules`` maps this name to that module itself, so
``mpx.quantize.compression_choice`` *is* the module in ``reduction/``.
The names bound below only tell type checkers what the module holds.
"""

import sys

from mpx.quantize.reduction import Choice, compression_choice

__all__ = ["MARGIN", "ROUNDS", "Choice", "Reduce", "choose"]

MARGIN = compression_choice.MARGIN
ROUNDS = compression_choice.ROUNDS
Reduce = compression_choice.Reduce
choose = compression_choice.choose

sys.modules[__name__] = compression_choice
