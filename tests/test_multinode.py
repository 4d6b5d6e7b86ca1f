"""Two "nodes" x 2 ranks (network namespaces, each a host to MPI) == one node x 4 ranks.

``mpxrun --virtual-nodes 2`` starts the ranks in two network namespaces joined
by veth pairs, with MPI started across them by Hydra as over ssh: the
collectives run hierarchically (shared memory within a namespace, TCP across).
A data-parallel training step and the collectives must give the same numbers
as the one-node run. Needs root and iproute2; skipped elsewhere.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpx.launch.virtual_cluster import VirtualCluster

JOB = Path(__file__).with_name("multinode_job.py")
MPXRUN = shutil.which("mpxrun", path=os.path.dirname(sys.executable)) or "mpxrun"


def _run(tmp_path: Path, *placement: str) -> dict[str, torch.Tensor]:
    out = tmp_path / f"result{len(placement)}.pt"
    proc = subprocess.run(
        [MPXRUN, *placement, "-n", "4", "--timeout", "300", "--", sys.executable, str(JOB),
         str(out)],
        capture_output=True, text=True, timeout=400, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result: dict[str, torch.Tensor] = torch.load(out)
    return result


@pytest.mark.skipif(not VirtualCluster.supported(), reason="needs root and iproute2 (netns)")
def test_two_virtual_nodes_match_one_node(tmp_path: Path) -> None:
    one = _run(tmp_path)
    two = _run(tmp_path, "--virtual-nodes", "2")
    assert one["nodes"] == 1
    assert two["nodes"] == 2
    # The same step: averaged gradients, summed in a different order -> rounding only.
    torch.testing.assert_close(two["params"], one["params"], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(two["allreduce"], one["allreduce"], rtol=0, atol=0)
    assert torch.equal(two["broadcast"], one["broadcast"])
    assert two["allgather"].flatten().tolist() == [0, 1, 2, 3]
