"""The only place mpx-pipeline touches torch names that are not public API.

``_BatchNorm`` and ``_DropoutNd`` are the base classes of every BatchNorm and
Dropout layer; torch exposes them only under leading-underscore names.
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["is_batchnorm", "is_dropout"]


def is_batchnorm(module: nn.Module) -> bool:
    """True for every BatchNorm1d/2d/3d (and SyncBatchNorm) layer."""
    return isinstance(module, _BatchNorm)


def is_dropout(module: nn.Module) -> bool:
    """True for every Dropout/AlphaDropout/FeatureAlphaDropout layer."""
    return isinstance(module, _DropoutNd)
