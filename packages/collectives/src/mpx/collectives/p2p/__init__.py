"""Point to point: the :class:`Channel` (tagged messages of tensors between two
ranks, in flight until settled), the first part of its every message
(``channel_wire``), what it keeps of messages in flight (``channel_state``)
and their settling (``channel_settle``), and a tensor's shape and dtype as a
header a receiver reads before it allocates (``tensor_header``).

May import: ``impl`` (``mpi``'s truncation error), ``core``, ``node``, ``base``.
"""

from mpx.collectives.p2p.channel import Channel
from mpx.collectives.p2p.tensor_header import HEADER_LEN, decode_header, encode_header

__all__ = ["HEADER_LEN", "Channel", "decode_header", "encode_header"]
