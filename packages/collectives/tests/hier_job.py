"""A 4-rank job (2 simulated nodes x 2 ranks) checking impl='hier' against numpy.

Started by test_impl_hier.py with MPX_RANKS_PER_NODE=2; exits non-zero on a mismatch.
"""

from __future__ import annotations

import numpy as np
import torch

from mpx.collectives import allreduce, broadcast, world

comm = world()
assert comm.num_nodes == 2, comm.num_nodes
assert comm.hierarchy is not None
assert comm.hierarchy.lanes is not None
for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12), (torch.float16, 5e-3)):
    # (5 << 20) + 1 float32 spans two 16 MiB shared-memory pieces.
    sizes = (1, 7, 1000, (5 << 20) + 1) if dtype == torch.float32 else (1, 7, 1000, 300_001)
    for n in sizes:
        # Every rank's input, made once per size (4 x 5M normals per op took most of
        # the job's time on 2 cores).
        inputs = [
            torch.from_numpy(np.random.default_rng([r, n]).normal(size=n)).to(dtype)
            for r in range(comm.size)
        ]
        stacked = np.stack([x.double().numpy() for x in inputs])
        for op in ("sum", "avg", "max", "min"):
            t = inputs[comm.rank].clone()
            allreduce(t, op, impl="hier")
            want = getattr(stacked, {"avg": "mean"}.get(op, op))(0)
            np.testing.assert_allclose(t.double().numpy(), want, rtol=tol, atol=tol)
for root in range(comm.size):
    t = torch.arange(1 << 19, dtype=torch.float32) * (comm.rank + 1)
    broadcast(t, root, impl="hier")
    np.testing.assert_array_equal(t.numpy(), np.arange(1 << 19, dtype=np.float32) * (root + 1))
if comm.rank == 0:
    print("hier job ok: 2 nodes x 2 ranks, lanes", flush=True)
