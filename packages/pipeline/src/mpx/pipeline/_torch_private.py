"""The only place mpx-pipeline touches torch names that are not public API.

``_BatchNorm`` and ``_DropoutNd`` are the base classes of every BatchNorm and
Dropout layer; torch exposes them only under leading-underscore names.
:func:`functional_checks_off` relies on how ``torch.nn.functional`` is written:
its Python functions look up ``has_torch_function*`` in their module's namespace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.nn import functional
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["functional_checks_off", "is_batchnorm", "is_dropout"]

_CHECKS = ("has_torch_function", "has_torch_function_unary", "has_torch_function_variadic")


def _never(*args: Any) -> bool:
    return False


def is_batchnorm(module: nn.Module) -> bool:
    """True for every BatchNorm1d/2d/3d (and SyncBatchNorm) layer."""
    return isinstance(module, _BatchNorm)


def is_dropout(module: nn.Module) -> bool:
    """True for every Dropout/AlphaDropout/FeatureAlphaDropout layer."""
    return isinstance(module, _DropoutNd)


@contextlib.contextmanager
def functional_checks_off() -> Iterator[None]:
    """Within the block, ``torch.nn.functional``'s Python functions (the attention's
    ``multi_head_attention_forward``, ``layer_norm``...) skip their own
    ``__torch_function__`` check, so that under a ``TorchFunctionMode`` their body
    runs and the mode sees the torch calls inside (``linear``, ``addmm``...) instead
    of the whole function as one call. Process-wide while it lasts: the pipeline's
    passes run on one thread."""
    space = functional.__dict__
    saved = {name: space[name] for name in _CHECKS}
    try:
        space.update(dict.fromkeys(_CHECKS, _never))
        yield
    finally:
        space.update(saved)
