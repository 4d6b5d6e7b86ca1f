"""Layer-parallel residual networks: the N residual steps solved in time with MGRIT.

What lives here: ``layer_parallel`` (:class:`LayerParallel` and the sequential
:class:`SerialResNet`), ``torchbraid_setters`` (torchbraid's setters on
``LayerParallel``, thin aliases of its settings), ``refinement``
(:func:`refine`: multilevel initialisation, a network with more steps; not
named ``refine``, so that ``refine`` here is the function) and ``replicas``
(:func:`split_replicas`: layer parallel x data parallel).

What it may import: ``mpx.mgrit.adjoint`` and ``mpx.mgrit.solver`` (through
their ``__init__``), ``mpx.mgrit._comm``, ``mpx.mgrit.errors`` and
mpx-collectives. Not ``gru``: the network beside it.
"""

from mpx.mgrit.resnet.layer_parallel import LayerParallel, SerialResNet
from mpx.mgrit.resnet.refinement import refine
from mpx.mgrit.resnet.replicas import ReplicaGroups, split_replicas

__all__ = ["LayerParallel", "ReplicaGroups", "SerialResNet", "refine", "split_replicas"]
