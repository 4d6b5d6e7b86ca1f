"""What importing mpx.pipeline costs (a fresh interpreter each time)."""

from __future__ import annotations


def test_the_package_leaves_sympy_to_the_pipeline_construction() -> None:
    """Autograd imports torch.fx's symbolic shapes (and sympy, seconds under load) at
    the first backward with explicit output gradients, stalling the other stages:
    a Pipeline imports them when it is built. Importing mpx.pipeline does not (it
    did at package load, a cost for every process). The module is taken out of
    sys.modules first, as whatever imported it before (mpx.collectives may) would
    hide what mpx.pipeline does."""
    import subprocess
    import sys

    code = (
        "import sys, mpx.collectives\n"
        "name = 'torch.fx.experimental.symbolic_shapes'\n"
        "sys.modules.pop(name, None)\n"
        "import mpx.pipeline\n"
        "print(name in sys.modules)\n"
        "from mpx.collectives import world\n"
        "import torch\n"
        "mpx.pipeline.Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1],"
        " comm=world().split(world().rank))\n"
        "print(name in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert out.stdout.split() == ["False", "True"], out.stdout + out.stderr
