"""The backward split into ``I`` and ``W``: what ``W`` needs, kept between the two.

What lives here: ``deferred`` (:class:`Records`: the weight gradients of a
chunk deferred from ``I`` to ``W`` as small records, and :func:`weight_grads`,
``W`` itself), ``graph_split`` (:class:`ChunkSplit`: ``I`` read from the
autograd graph, the matrix products' weights left for ``W``), ``capture``
(the ``TorchFunctionMode`` that finds a chunk's other weight calls while its
forward runs) and ``retained`` (:class:`Kept`: a forward that captured
nothing keeps its graph from ``I`` to ``W``). Autograd only: no messages, no
schedule.

What it may import: ``mpx.pipeline._torch_private`` (``capture`` switches
``torch.nn.functional``'s own checks off), and torch. Not ``model``,
``schedules`` or ``staleness``: the roles beside it. ``runtime``'s passes
call it, through this ``__init__``.
"""

from mpx.pipeline.split_backward.deferred import Held, Records, weight_grads
from mpx.pipeline.split_backward.graph_split import ChunkSplit
from mpx.pipeline.split_backward.retained import Kept, input_grad

__all__ = ["ChunkSplit", "Held", "Kept", "Records", "input_grad", "weight_grads"]
