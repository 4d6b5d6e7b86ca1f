"""torchbraid's setters on LayerParallel: the same network as the constructor's keywords."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from mpx.collectives import world
from mpx.mgrit import LayerParallel, MGRITConfigError, SerialResNet

pytestmark = pytest.mark.mpi


def build(**kw: Any) -> LayerParallel:
    torch.manual_seed(0)  # every rank builds the same weights
    return LayerParallel(
        nn.Linear(4, 6), lambda: nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3),
        num_steps=48, Tf=2.0, **kw,
    ).double()  # fmt: skip


def run(net: LayerParallel) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    y = net(x)
    y.square().sum().backward()
    every = [p.grad.detach().clone() for p in net.parameters() if p.grad is not None]
    return y.detach(), every


def test_setters_give_the_keywords_network() -> None:
    settings = {"levels": 3, "cfactor": 4, "fwd_iters": 2, "bwd_iters": 1, "relax": "FCF",
                "nrelax": 1, "fine_relax": "F", "fwd_tol": 1e-8, "bwd_tol": 1e-6,
                "skip_downcycle": False}  # fmt: skip
    keywords = build(**settings)
    setters = build()  # levels=2, cfactor=2 by default: the split changes with the factor
    setters.setMaxLevels(3)
    setters.setCFactor(4)
    setters.setFwdMaxIters(2)
    setters.setBwdMaxIters(1)
    setters.setFwdAbsTol(1e-8)
    setters.setBwdAbsTol(1e-6)
    setters.setNumRelax(1)  # FCF on the coarse levels ...
    setters.setFwdNumRelax(0, level=0)  # ... F on the fine one, in both solves
    setters.setBwdNumRelax(0, level=0)
    setters.setSkipDowncycle(False)
    assert setters.options == keywords.options
    assert list(setters.owned_steps()) == list(keywords.owned_steps())
    # The layers moved with the split, weights kept: the same network and training step.
    mine, theirs = dict(setters.named_parameters()), dict(keywords.named_parameters())
    assert mine.keys() == theirs.keys()
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), name
    (y1, g1), (y2, g2) = run(setters), run(keywords)
    # To rounding: the re-placed layers are copies (other memory for the batched products).
    torch.testing.assert_close(y1, y2, rtol=0, atol=1e-14)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    setters.close()
    keywords.close()


def test_cfactor_of_one_coarsening_and_levels_per_solve() -> None:
    net = build(levels=3, cfactor=2)
    net.setCFactor(4, level=1)
    net.setFwdMaxLevels(2)
    net.setBwdMaxLevels(3)
    assert (net.options.cfactor, net.options.forward_levels, net.options.adjoint_levels) == (
        (2, 4),
        2,
        3,
    )
    with pytest.raises(MGRITConfigError, match=r"level=5 .* 0\.\.1"):
        net.setCFactor(2, level=5)
    net.close()


def test_the_solves_relax_alike_and_setters_come_before_the_forward() -> None:
    net = build(levels=3)
    net.setFwdNumRelax(0, level=0)
    with pytest.raises(MGRITConfigError, match=r"setBwdNumRelax\(1, level=0\).*forward"):
        net.setBwdNumRelax(1, level=0)
    with pytest.raises(MGRITConfigError, match="level=2"):
        net.setNumRelax(1, level=2)
    run(net)
    with pytest.raises(MGRITConfigError, match="before the first forward"):
        net.setFwdMaxIters(3)
    net.close()


def test_sequential_on_root_and_the_print_level(capsys: pytest.CaptureFixture[str]) -> None:
    net = build(levels=2)
    serial = net.buildSequentialOnRoot()
    assert isinstance(serial, SerialResNet) == (world().rank == 0)
    assert serial is None or len(serial.steps) == 48
    net.setPrintLevel(1)
    run(net)
    run(net)
    printed = capsys.readouterr().out
    if world().rank == 0:
        assert printed.count("LayerParallel: forward residuals") == 2, printed
    else:
        assert "LayerParallel" not in printed
    net.close()
