"""What the ranks on one node share and how a rank finds them: the node's
ranks and the host's cores (``topology``), the call board where they compare
each collective call (``call_board``), and the flags in shared memory of the
small shm allreduce (``shm_flags``).

May import: ``base`` (and the top-level ``settings``).
"""

from mpx.collectives.node.call_board import ROW, SLOT, Arrival, CallBoard, calls_differ
from mpx.collectives.node.call_board import use_compiled as use_compiled_board
from mpx.collectives.node.shm_flags import CODES, FLAG_BYTES, FlagWindow
from mpx.collectives.node.shm_flags import takes as flags_take
from mpx.collectives.node.shm_flags import use_compiled as use_compiled_flags
from mpx.collectives.node.topology import note_host_ranks, split_node, usable_cores, waits_yielding

__all__ = [
    "CODES",
    "FLAG_BYTES",
    "ROW",
    "SLOT",
    "Arrival",
    "CallBoard",
    "FlagWindow",
    "calls_differ",
    "flags_take",
    "note_host_ranks",
    "split_node",
    "usable_cores",
    "use_compiled_board",
    "use_compiled_flags",
    "waits_yielding",
]
