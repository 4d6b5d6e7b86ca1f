"""LayerParallel against its own serial network (plain torch autograd), on any rank count."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from mpi4py import MPI
from torch import nn

from mpx.collectives import world
from mpx.mgrit import LayerParallel, MGRITConfigError, MGRITTypeError, SerialResNet

pytestmark = pytest.mark.mpi


def build(n: int, width: int = 6, dtype: torch.dtype = torch.float64, **kw: Any) -> LayerParallel:
    torch.manual_seed(0)  # every rank builds the same weights
    steps = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(n)]
    net = LayerParallel(nn.Linear(4, width), steps, nn.Linear(width, 3), n, Tf=2.0, **kw)
    return net.to(dtype)


def serial_name(net: LayerParallel, name: str) -> str:
    """The name in ``net.serial()`` of the parameter ``name`` of ``net``."""
    if not name.startswith("local_steps."):
        return name
    _, k, rest = name.split(".", 2)
    return f"steps.{int(k) + net.first_step}.{rest}"


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None, "backward reached every parameter"
    return p.grad


def compare(net: LayerParallel, dtype: torch.dtype = torch.float64) -> dict[str, float]:
    """Max abs differences of output, input gradient and parameter gradients vs serial."""
    serial = net.serial()
    assert isinstance(serial, SerialResNet)
    assert len(serial.steps) == net.num_steps
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=dtype)
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yp, ys = net(xp), serial(xs)
    yp.square().sum().backward()
    ys.square().sum().backward()
    ref = dict(serial.named_parameters())
    params = max(
        (
            (_grad(p) - _grad(ref[serial_name(net, n)])).abs().max().item()
            for n, p in net.named_parameters()
        ),
        default=0.0,
    )
    assert xp.grad is not None
    assert xs.grad is not None
    return {
        "output": (yp - ys).abs().max().item(),
        "input_grad": (xp.grad - xs.grad).abs().max().item(),
        "param_grads": params,
    }


@pytest.mark.parametrize("iters", [1, 3])
def test_one_level_equals_serial(iters: int) -> None:
    net = build(12, levels=1, fwd_iters=iters, bwd_iters=iters)
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors
    assert net.fwd_stats()["residuals"] == [0.0]


def test_as_many_iterations_as_steps_equals_serial() -> None:
    net = build(16, levels=3, cfactor=2, fwd_iters=16, bwd_iters=16, tol=0.0)
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


def test_three_levels_eight_iterations_close_to_serial() -> None:
    net = build(64, levels=3, cfactor=4, fwd_iters=8, bwd_iters=8, tol=0.0, relax="F")
    errors = compare(net)
    assert max(errors.values()) <= 1e-6, errors
    assert len(net.fwd_stats()["residuals"]) == 8
    assert len(net.bwd_stats()["residuals"]) == 8


def test_inexact_solves_improve_with_iterations() -> None:
    errs = [max(compare(build(32, levels=3, cfactor=2, fwd_iters=i, bwd_iters=i, tol=0.0)).values())
            for i in (1, 2, 4)]  # fmt: skip
    assert errs[0] > errs[1] > errs[2], errs
    assert errs[0] > 1e-6  # the inexact solve is really inexact


def test_f_cycles_solve_forward_and_adjoint_closer_than_v_cycles() -> None:
    # Four levels: an F-cycle does more coarse work per iteration than a V-cycle, so the
    # same iterations end closer to the serial network, forward and backward.
    errs = {}
    for cycle_type in ("V", "F"):
        net = build(32, levels=4, cfactor=2, fwd_iters=2, bwd_iters=2, tol=0.0,
                    cycle_type=cycle_type)  # fmt: skip
        errs[cycle_type] = compare(net)
    for key in ("output", "input_grad", "param_grads"):
        assert errs["F"][key] < errs["V"][key], errs
    net = build(32, levels=4, cfactor=2, fwd_iters=12, bwd_iters=12, tol=0.0, cycle_type="F")
    assert max(compare(net).values()) <= 1e-12


def test_replicated_layers_get_the_same_gradients_and_output_on_every_rank() -> None:
    net = build(12, levels=2, fwd_iters=2, bwd_iters=1)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y = net(x)
    y.sum().backward()
    comm = world()
    mine = [y.detach()] + [p.grad for n, p in net.named_parameters() if "local_steps" not in n]
    everyone = comm.mpi.allgather(mine)
    for other in everyone:
        for a, b in zip(mine, other, strict=True):
            assert torch.equal(a, b)
    # Each step layer lives on exactly one rank.
    owned = comm.mpi.allgather(list(net.owned_steps()))
    assert sorted(k for part in owned for k in part) == list(range(12))


def test_float32_and_single_module_copied_per_step() -> None:
    torch.manual_seed(0)
    net = LayerParallel(nn.Identity(), nn.Linear(4, 4), nn.Identity(), 6, Tf=1.0, levels=1)
    weights = [layer.weight for layer in net.local_steps]
    assert len({id(w) for w in weights}) == len(weights)
    errors = compare(net, torch.float32)
    assert max(errors.values()) <= 1e-5, errors


def test_factory_makes_one_layer_per_step_the_same_on_any_rank_count() -> None:
    calls = []

    def factory() -> nn.Module:
        calls.append(1)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    torch.manual_seed(0)
    net = LayerParallel(nn.Identity(), factory, nn.Identity(), 6, Tf=1.0, levels=2, fwd_iters=6,
                        bwd_iters=6, tol=0.0).double()  # fmt: skip
    assert len(calls) == 6  # every rank makes every step's layer and keeps its own
    assert len(net.local_steps) == len(net.owned_steps())
    torch.manual_seed(0)
    alone = [factory().double() for _ in range(6)]
    for got, want in zip(net.gather_steps(), alone, strict=True):
        for p, q in zip(got.parameters(), want.parameters(), strict=True):
            assert torch.equal(p, q)
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


def test_a_class_is_a_factory_too() -> None:
    net = LayerParallel(nn.Identity(), functools.partial(nn.Linear, 3, 3), nn.Identity(), 4)
    weights = [layer.get_parameter("weight") for layer in net.gather_steps()]
    assert len(weights) == 4
    assert all(not torch.equal(weights[0], w) for w in weights[1:])


@pytest.mark.parametrize(
    ("step_layers", "words"),
    [
        (lambda: 3, ["factory must return an nn.Module", "int", "lambda: StepLayer"]),
        (42, ["step_layers must be", "factory", "int"]),
    ],
)
def test_bad_step_layers_are_a_type_error(step_layers: Any, words: list[str]) -> None:
    with pytest.raises(MGRITTypeError) as info:
        LayerParallel(nn.Identity(), step_layers, nn.Identity(), 4)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_step_list_is_refused() -> None:
    with pytest.raises(MGRITConfigError, match="3 modules but num_steps=4"):
        LayerParallel(nn.Identity(), [nn.Linear(2, 2)] * 3, nn.Identity(), 4)
    with pytest.raises(MGRITConfigError, match="nt=6 is not divisible"):
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 6, levels=3, cfactor=2)


def test_more_ranks_than_coarse_intervals() -> None:
    # 4 steps, 2 levels: 2 coarsest intervals; under 3 ranks one rank holds no layer.
    net = build(4, levels=2, cfactor=2, fwd_iters=4, bwd_iters=4, tol=0.0)
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize(
    ("n", "levels", "cfactor"), [(64, 4, 4), (64, 6, 2), (48, 3, [4, 3]), (32, 5, 2)]
)
@pytest.mark.parametrize("batched", [True, False])
def test_inexact_solves_equal_the_single_rank_network(
    n: int, levels: int, cfactor: Any, batched: bool
) -> None:
    # Ranks beyond the coarsest intervals, coarse intervals cut by rank boundaries: each
    # rank's boundary steps use its neighbours' layers (carried, not owned), and two
    # inexact V-cycles give what one rank gives (to rounding: batched products of other
    # sizes).
    kw: dict[str, Any] = {"levels": levels, "cfactor": cfactor, "fwd_iters": 2,
                          "bwd_iters": 1, "tol": 0.0, "batched": batched}  # fmt: skip
    nets = [build(n, comm=comm, **kw) for comm in (MPI.COMM_WORLD, MPI.COMM_SELF)]
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for _ in range(2):  # a second step after SGD: the carried layers follow the owners
        outs = []
        for net in nets:
            net.zero_grad()
            y = net(x)
            y.square().sum().backward()
            outs.append(y.detach())
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-12)
        mine, alone = dict(nets[0].named_parameters()), dict(nets[1].named_parameters())
        for name, p in mine.items():
            other = serial_name(nets[0], name).replace("steps.", "local_steps.", 1)
            torch.testing.assert_close(
                _grad(p), _grad(alone[other if other in alone else name]), rtol=0, atol=1e-12
            )
        for net in nets:
            with torch.no_grad():
                for p in net.parameters():
                    p.sub_(0.1 * _grad(p))
    residuals = [net.fwd_stats()["residuals"] for net in nets]
    torch.testing.assert_close(torch.tensor(residuals[0]), torch.tensor(residuals[1]))
    for net in nets:
        net.close()


@pytest.mark.gpu
def test_cuda_network_equals_serial() -> None:
    net = build(8, levels=2, fwd_iters=8, bwd_iters=8, tol=0.0).cuda()
    serial = net.serial()
    x = torch.randn(5, 4, dtype=torch.float64, device="cuda")
    xp, xs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    yp, ys = net(xp), serial(xs)
    assert yp.device.type == "cuda"
    torch.autograd.backward(yp.square().sum())
    torch.autograd.backward(ys.square().sum())
    assert xp.grad is not None
    assert xs.grad is not None
    torch.testing.assert_close(yp, ys, rtol=0, atol=1e-12)
    torch.testing.assert_close(xp.grad, xs.grad, rtol=0, atol=1e-12)


def test_two_forward_passes_before_one_backward() -> None:
    # Each backward uses the states of its own forward pass (kept in the autograd graph).
    net = build(8, levels=2, fwd_iters=8, bwd_iters=8, tol=0.0)
    serial = net.serial()
    gen = torch.Generator().manual_seed(4)
    x1, x2 = (torch.randn(3, 4, dtype=torch.float64, generator=gen) for _ in range(2))
    torch.autograd.backward(net(x1).square().sum() + net(x2).sum())
    torch.autograd.backward(serial(x1).square().sum() + serial(x2).sum())
    ref = dict(serial.named_parameters())
    for name, p in net.named_parameters():
        q = ref[serial_name(net, name)]
        assert p.grad is not None
        assert q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


# -- separate forward and adjoint settings (torchbraid's max_fwd_levels, setBwdAbsTol...) --


def test_forward_and_adjoint_levels_are_separate() -> None:
    net = build(16, fwd_levels=3, bwd_levels=1, fwd_iters=2, bwd_iters=1, tol=0.0)
    assert (net.stepper.fwd.num_levels, net.stepper.bwd.num_levels) == (3, 1)
    errors = compare(net)
    assert net.bwd_stats()["residuals"] == [0.0]  # one level: the exact sequential adjoint
    assert len(net.fwd_stats()["residuals"]) == 2
    assert net.fwd_stats()["residuals"][-1] > 0.0  # the forward solve stays inexact
    assert errors["output"] > 1e-9


@pytest.mark.parametrize(("fwd_levels", "bwd_levels"), [(4, 2), (2, 4), (1, 3)])
def test_different_levels_iterated_to_convergence_equal_serial(
    fwd_levels: int, bwd_levels: int
) -> None:
    # 24 steps: the coarsest intervals of the two grids differ (up to 8 steps), yet each
    # rank keeps the same steps in both solves (under 3 ranks too).
    net = build(24, cfactor=2, fwd_levels=fwd_levels, bwd_levels=bwd_levels,
                fwd_iters=24, bwd_iters=24, tol=0.0)  # fmt: skip
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


def test_forward_and_adjoint_tolerances_are_separate() -> None:
    net = build(32, levels=3, fwd_iters=10, bwd_iters=10, fwd_tol=1e-4, bwd_tol=0.0)
    compare(net)
    fwd, bwd = net.fwd_stats(), net.bwd_stats()
    assert fwd["iterations"] < 10
    assert fwd["residuals"][-1] < 1e-4 <= fwd["residuals"][-2]
    assert bwd["iterations"] == 10
    net = build(32, levels=3, fwd_iters=10, bwd_iters=10, tol=1e-4)  # the shared default
    compare(net)
    assert net.fwd_stats()["iterations"] == fwd["iterations"]
    assert net.bwd_stats()["iterations"] < 10


def test_fine_relax_changes_both_solves_and_converges() -> None:
    histories = []
    for relax, fine in [("F", None), ("FCF", None), ("FCF", "F")]:
        net = build(32, levels=3, relax=relax, fine_relax=fine, fwd_iters=2, bwd_iters=2, tol=0.0)
        compare(net)
        histories.append((net.fwd_stats()["residuals"], net.bwd_stats()["residuals"]))
    assert histories[2][0] not in (histories[0][0], histories[1][0])
    assert histories[2][1] not in (histories[0][1], histories[1][1])
    net = build(32, levels=3, relax="FCF", fine_relax="F", fwd_iters=16, bwd_iters=16, tol=0.0)
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"fwd_levels": 0}, ["fwd_levels=0", ">= 1"]),
        ({"bwd_levels": 2.0}, ["bwd_levels=2.0", "int"]),
        ({"fwd_tol": -1.0}, ["fwd_tol=-1.0", ">= 0"]),
        ({"tol": float("nan")}, ["tol=nan"]),
        ({"bwd_tol": "0"}, ["bwd_tol='0'", "number"]),
        ({"fine_relax": "C"}, ["fine_relax", "'C'"]),
        ({"fwd_levels": 3, "bwd_levels": 1}, ["num_steps=6", "fwd_levels=3", "multiple of 4"]),
    ],
)
def test_bad_forward_or_adjoint_settings_name_the_value(
    kwargs: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(MGRITConfigError) as info:
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 6, cfactor=2, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_a_raw_mpi4py_communicator_is_accepted() -> None:
    # torchbraid's convention: LayerParallel(MPI.COMM_WORLD, ...).
    net = build(8, comm=MPI.COMM_WORLD, levels=2, fwd_iters=8, bwd_iters=8, tol=0.0)
    assert net.comm.size == MPI.COMM_WORLD.Get_size()
    assert net.owned_steps() == build(8, levels=2).owned_steps()
    errors = compare(net)
    assert max(errors.values()) <= 1e-12, errors


def test_a_comm_of_another_kind_is_a_type_error() -> None:
    with pytest.raises(MGRITTypeError, match=r"comm must be an mpx\.collectives.*str"):
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 4, comm="world")  # type: ignore[arg-type]
