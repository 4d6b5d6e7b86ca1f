"""MGRITOptions: MGRIT's settings as one frozen value, checked once; keywords still work."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
import torch
from torch import nn

from mpx.mgrit import LayerParallel, MGRITConfigError, MGRITOptions, MGRITTypeError, ParallelGRU
from mpx.mgrit.adjoint import TimeStepper
from mpx.mgrit.solver import MGRITSettings

# The defaults the constructors' signatures had before the settings became one type
# (written out here as the independent record of what must not change).
LAYER_PARALLEL_DEFAULTS = {
    "levels": 2, "cfactor": 2, "fwd_iters": 2, "bwd_iters": 1, "tol": 1e-9, "relax": "F",
    "nrelax": 1, "skip_downcycle": True, "fwd_levels": None, "bwd_levels": None,
    "fwd_tol": None, "bwd_tol": None, "fine_relax": None, "cycle_type": "V",
}  # fmt: skip
GRU_DEFAULTS = {**LAYER_PARALLEL_DEFAULTS, "bwd_iters": 2, "relax": "FCF"}


def test_defaults_are_each_class_s_old_defaults() -> None:
    assert MGRITOptions().as_dict() == LAYER_PARALLEL_DEFAULTS
    assert LayerParallel.defaults.as_dict() == LAYER_PARALLEL_DEFAULTS
    assert TimeStepper.defaults.as_dict() == LAYER_PARALLEL_DEFAULTS
    assert ParallelGRU.defaults.as_dict() == GRU_DEFAULTS


def test_the_keyword_types_are_the_fields() -> None:
    # MGRITSettings types **settings for type checkers: the same names and types.
    hints = typing.get_type_hints(MGRITSettings)
    fields = typing.get_type_hints(MGRITOptions)
    assert list(hints) == list(fields)
    # The same types, but for cfactor: any sequence as a keyword, kept as a tuple.
    assert {k: v for k, v in hints.items() if k != "cfactor"} == {
        k: v for k, v in fields.items() if k != "cfactor"
    }


def test_options_are_frozen_and_hashable() -> None:
    opts = MGRITOptions(levels=3, cfactor=[4, 2])  # type: ignore[arg-type]
    assert opts.cfactor == (4, 2)
    assert hash(opts) == hash(MGRITOptions(levels=3, cfactor=(4, 2)))
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.levels = 4  # type: ignore[misc]
    assert (opts.forward_levels, opts.adjoint_levels) == (3, 3)
    split = MGRITOptions(fwd_levels=3, bwd_levels=1, tol=0, bwd_tol=1e-6)
    assert (split.forward_levels, split.adjoint_levels) == (3, 1)
    assert (split.forward_tol, split.adjoint_tol) == (0.0, 1e-6)
    assert isinstance(split.tol, float)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"levels": 0}, MGRITConfigError, ["levels=0", ">= 1"]),
        ({"fwd_levels": 0}, MGRITConfigError, ["fwd_levels=0", ">= 1"]),
        ({"bwd_levels": 2.0}, MGRITConfigError, ["bwd_levels=2.0", "int"]),
        ({"cfactor": 1}, MGRITConfigError, ["cfactor=1", "use cfactor=2 or more"]),
        ({"cfactor": "4"}, MGRITTypeError, ["cfactor='4'", "cfactor=[4, 2]"]),
        ({"levels": 3, "cfactor": [2]}, MGRITConfigError, ["cfactor=[2]", "levels=3 needs 2"]),
        ({"fwd_iters": 0}, MGRITConfigError, ["fwd_iters=0", ">= 1"]),
        ({"bwd_iters": True}, MGRITConfigError, ["bwd_iters=True", "int"]),
        ({"tol": -1.0}, MGRITConfigError, ["tol=-1.0", ">= 0"]),
        ({"bwd_tol": "0"}, MGRITConfigError, ["bwd_tol='0'", "number"]),
        ({"relax": "FC"}, MGRITConfigError, ["relax", "'FC'", '"FCF"']),
        ({"fine_relax": "C"}, MGRITConfigError, ["fine_relax", "'C'", "None"]),
        ({"nrelax": -1}, MGRITConfigError, ["nrelax=-1", ">= 0"]),
        ({"cycle_type": "W"}, MGRITConfigError, ["cycle_type", "'W'", '"V" or "F"']),
        ({"skip_downcycle": "yes"}, MGRITTypeError, ["skip_downcycle='yes'", "True or False"]),
    ],
)
def test_a_bad_setting_is_refused_when_the_options_are_made(
    kwargs: dict[str, Any], error: type[Exception], words: list[str]
) -> None:
    with pytest.raises(error) as info:
        MGRITOptions(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_options_and_keywords_together_are_refused() -> None:
    opts = MGRITOptions(levels=1)
    with pytest.raises(MGRITConfigError) as info:
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 4, options=opts, levels=2)
    assert "options= and the settings ['levels']" in str(info.value)
    assert "dataclasses.replace(options, levels=...)" in str(info.value)
    with pytest.raises(MGRITConfigError, match=r"ParallelGRU got options= .*\['tol'\]"):
        ParallelGRU(3, 5, options=opts, tol=0.0)


def test_options_of_another_type_and_unknown_settings_are_type_errors() -> None:
    with pytest.raises(MGRITTypeError, match="options must be an MGRITOptions, got dict"):
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 4, options={"levels": 1})  # type: ignore[arg-type]
    with pytest.raises(MGRITTypeError) as info:
        LayerParallel(nn.Identity(), nn.Linear(2, 2), nn.Identity(), 4, iters=3)  # type: ignore[call-arg]
    assert "unknown settings ['iters']" in str(info.value)
    assert "'fwd_iters'" in str(info.value)


@pytest.mark.mpi
def test_keywords_and_options_build_the_same_network() -> None:
    def net(**kw: Any) -> LayerParallel:
        torch.manual_seed(0)
        return LayerParallel(
            nn.Linear(3, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh()), nn.Linear(4, 2), 8,
            **kw,
        ).double()  # fmt: skip

    settings: dict[str, Any] = {"levels": 3, "fwd_iters": 3, "bwd_tol": 0.0, "relax": "FCF"}
    by_keywords, by_options = net(**settings), net(options=MGRITOptions(**settings))
    assert by_keywords.options == by_options.options == MGRITOptions(**settings)
    assert by_keywords.config == {**LAYER_PARALLEL_DEFAULTS, **settings}
    solvers = by_keywords.stepper, by_options.stepper
    assert {(s.fwd.num_levels, s.fwd.max_iters, s.bwd.tol, s.fwd.ncf) for s in solvers} == {
        (3, 3, 0.0, 1)
    }
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(by_keywords(x), by_options(x))
    for each in (by_keywords, by_options):
        each.close()


@pytest.mark.mpi
def test_the_gru_keeps_its_own_defaults_and_takes_options() -> None:
    gru = ParallelGRU(3, 5, seq_len=8, levels=2, cfactor=2)
    assert gru.options == dataclasses.replace(ParallelGRU.defaults, levels=2, cfactor=2)
    stepper = gru._grids[8][0].stepper
    assert (stepper.fwd.ncf, stepper.bwd.max_iters) == (1, 2)  # FCF, 2 adjoint cycles
    given = ParallelGRU(3, 5, seq_len=8, options=MGRITOptions(levels=2))
    first = given._grids[8][0].stepper
    assert (first.fwd.ncf, first.bwd.max_iters) == (0, 1)  # the options as they are
    gru.close()
    given.close()
