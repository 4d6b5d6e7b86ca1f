"""Live recovery: data parallelism across replica groups that survives a group's death.

What lives here: :class:`FaultTolerantOptimizer` (``optimizer``: averages the
gradients over the live groups and steps when the lighthouse commits the step;
decides who hands a returning group the live state), ``catching_up`` (that
state sent and loaded: the donor's, and the loop's after the step the group
joined), ``gradients`` (the step's gradients: their buffers, their exchange,
their sum in the members' order, and a joining group's receipt) and what they
talk over, none of it MPI (MPI cannot outlive a peer's death): ``links`` (TCP links between the
groups and their frames), ``shm`` (the same-host path: gradients in a shared
memory segment), ``lighthouse_client`` (membership and heartbeats) and
``state_payload`` (the live state as a frame's payload). See
docs/live-recovery.md.

What it may import: ``mpx.dataparallel.errors`` and
``mpx.dataparallel.synchronous`` (a ``DistributedOptimizer`` inside each
group), mpi4py (within a group), and mpx-launch's public API (the job's key
and its challenge-response, ``mpx.launch.JobKey``); the lighthouse only
through the wire; mpx.quantize's public API, imported only when ``compression=``
asks for it (an optional dependency). Not ``asynchronous`` or ``checkpoints``: the
roles beside it.
"""

from mpx.dataparallel.recovery.optimizer import FaultTolerantOptimizer, TrainingFinished

__all__ = ["FaultTolerantOptimizer", "TrainingFinished"]
