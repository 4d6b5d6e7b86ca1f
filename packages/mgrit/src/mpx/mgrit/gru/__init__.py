"""ParallelGRU: a GRU over a long sequence, parallel in time; a drop-in for torch.nn.GRU.

What lives here: ``gru`` (:class:`ParallelGRU`: its layers and directions,
torch.nn.GRU's parameters) and ``gru_layer`` (one direction of one layer across
the ranks: its steps, its grid, its autograd). Its batched steps
(``GRUSteps``) live in ``adjoint``, whose stepper runs them.

What it may import: ``mpx.mgrit.adjoint`` and ``mpx.mgrit.solver`` (through
their ``__init__``), ``mpx.mgrit._comm``, ``mpx.mgrit.errors`` and
mpx-collectives. Not ``resnet``: the network beside it.
"""

from mpx.mgrit.gru.gru import ParallelGRU

__all__ = ["ParallelGRU"]
