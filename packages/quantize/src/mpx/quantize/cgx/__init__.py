"""CGX compatibility inside mpx.quantize: what only CGX's API needs.

CGX (IST-DASLab/torch_cgx) users write ``import torch_cgx``,
``dist.init_process_group("cgx")`` and ``from cgx_utils import CGXState,
cgx_hook``. The modules ``torch_cgx`` and ``cgx_utils`` (beside ``mpx``, under
CGX's own names) are thin shims over this subpackage and the rest of
mpx.quantize. What lives here: ``torch_backend`` (the ``"cgx"``
torch.distributed backend, :class:`CGXProcessGroup`: mpx-collectives' ``mpx``
group whose float all_reduce is the compressed allreduce), ``cgx_layers``
(CGX's per-layer table, ``torch_cgx.register_layer``, and the ``CGX_*``
variables read again at every all_reduce) and ``buckets``
(:class:`BucketMatcher`: which registered layers a flat DDP bucket holds).

What it may import: ``mpx.quantize.reduction`` and ``mpx.quantize.codec``
(through their ``__init__``), ``mpx.quantize.errors``,
``mpx.quantize.settings``, mpx-collectives (``torch_backend``). Nothing in
mpx.quantize imports this subpackage (the public path
``mpx.quantize.torch_backend`` aside).

``torch_backend`` is not re-exported here: importing it imports
mpx-collectives, and with it MPI, which ``import torch_cgx`` must not start.
Import it as ``mpx.quantize.cgx.torch_backend`` where the group is created.
"""

from mpx.quantize.cgx.buckets import BucketMatcher, Segments
from mpx.quantize.cgx.cgx_layers import EnvConfig, LayerSpec, LayerTable, layer_table

__all__ = ["BucketMatcher", "EnvConfig", "LayerSpec", "LayerTable", "Segments", "layer_table"]
