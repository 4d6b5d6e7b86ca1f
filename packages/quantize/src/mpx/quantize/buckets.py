"""``mpx.quantize.buckets``, the ``"cgx"`` backend's layer filtering: the module
:mod:`mpx.quantize.cgx.buckets`.

The module lives in ``cgx/`` (issue 57: CGX compatibility, marked as such).
This path stays because users import :class:`BucketMatcher` by it (the
README's API table). ``sys.modules`` maps this name to that module itself:
``mpx.quantize.buckets`` *is* ``mpx.quantize.cgx.buckets``.
The names bound below only tell type checkers what the module holds.
"""

import sys

from mpx.quantize.cgx import buckets

__all__ = ["BucketMatcher", "Segments"]

BucketMatcher = buckets.BucketMatcher
Segments = buckets.Segments

sys.modules[__name__] = buckets
