"""What ``import mpx.collectives`` loads: every rank of every job pays it at start-up."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.timeout(120)
def test_importing_mpx_collectives_leaves_torch_dynamo_unloaded() -> None:
    """torch._dynamo (and sympy with it) took 1.4 of the 1.6 s of the import.

    The torch backend's classes wrap their entry points in
    ``torch.compiler.disable`` at the first process group, not at import.
    """
    code = (
        "import sys, torch, mpx.collectives\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))"
    )
    # A fresh interpreter outside any job: a rank's launcher variables would make
    # its MPI join (or abort) the job of the process that runs this test.
    launcher = ("PMI", "PMIX", "HYDRA", "HYDI", "MPIR", "OMPI", "MPX_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(launcher)}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
