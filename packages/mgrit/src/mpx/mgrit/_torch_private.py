"""The one module of mpx-mgrit that reads private torch APIs.

Version counters: ``Tensor._version`` counts the in-place changes of a tensor's
data (an optimizer's step, ``p.copy_()`` under ``no_grad``); autograd reads it to
detect a saved tensor changed in place. It exists with this name from torch 1.x
to 2.13. mpx.mgrit keys its stacked weights on it, so that they are stacked once
per optimizer step and restacked when a weight changed.
"""

from __future__ import annotations

import torch

__all__ = ["version"]


def version(tensor: torch.Tensor) -> int:
    """How many times ``tensor``'s data was changed in place."""
    return int(tensor._version)
