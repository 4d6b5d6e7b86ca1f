"""MGRIT's settings as one value: :class:`MGRITOptions`, checked once when it is made.

:class:`~mpx.mgrit.LayerParallel`, :class:`~mpx.mgrit.ParallelGRU` and the
solver pair under them (:class:`~mpx.mgrit.adjoint.TimeStepper`) take the same
settings: the grid (``levels``, ``cfactor``), the iterations and tolerances of the
forward and of the adjoint solve, the relaxation and the cycle. They take them
as keywords (``levels=3, fwd_iters=4``), as they always did, or as one
``options=MGRITOptions(...)``, never both; either way each object carries one
:class:`MGRITOptions` (its ``options`` attribute), not a dict, and every setting is
checked here, once, with the value and the fix in the message.

The checks of single values (:func:`check_tol`, :func:`check_int`,
:func:`check_choice`) are also the plain :class:`~mpx.mgrit.MGRIT` solver's, so
that one setting is refused with one message wherever it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

from mpx.mgrit.errors import MGRITConfigError, MGRITTypeError
from mpx.mgrit.solver.grid import coarsening_factors

__all__ = ["MGRITOptions", "MGRITSettings", "check_choice", "check_int", "check_tol", "resolve"]

#: The relaxations MGRIT knows: F only, or F then ``nrelax`` times C and F.
RELAXATIONS = ("F", "FCF")
#: The cycles MGRIT knows, as PyMGRIT names them.
CYCLES = ("V", "F")


def check_tol(tol: float, name: str) -> float:
    """``tol`` as a float, or an error naming the argument ``name`` and the fix."""
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not tol >= 0:
        raise MGRITConfigError(
            f"{name} must be a number >= 0 (the residual norm to stop at; 0 runs every "
            f"iteration), got {name}={tol!r}"
        )
    return float(tol)


def check_int(value: int, name: str, minimum: int, meaning: str = "") -> int:
    """``value`` if it is an int >= ``minimum`` (not a bool), else an error naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        why = f" ({meaning})" if meaning else ""
        raise MGRITConfigError(f"{name} must be an int >= {minimum}{why}, got {name}={value!r}")
    return value


def check_choice(value: str, name: str, choices: Sequence[str], note: str = "") -> str:
    """``value`` if it is one of ``choices``, else an error naming it and the choices."""
    if value not in choices:
        names = " or ".join(f'"{c}"' for c in choices)
        raise MGRITConfigError(f"{name} must be {names}{note}, got {value!r}")
    return value


@dataclass(frozen=True)
class MGRITOptions:
    """The settings of an MGRIT forward solve and of its adjoint, checked when made.

    Args:
        levels: grid levels of both solves (1 = a sequential solve).
        cfactor: coarsening factor, one int or one per coarsening (kept as a tuple).
        fwd_iters, bwd_iters: the most MGRIT cycles of the forward and of the adjoint solve.
        tol: stop either solve once its residual norm is below this (0: run every cycle).
        relax: ``"F"`` or ``"FCF"`` (F, then ``nrelax`` times C and F).
        nrelax: CF sweeps after the first F sweep (FCF only).
        skip_downcycle: build the first guess coarse to fine (PyMGRIT's nested iteration).
        fwd_levels, bwd_levels: levels of the forward and of the adjoint solve
            (None: ``levels``; torchbraid's ``max_fwd_levels``/``max_bwd_levels``).
        fwd_tol, bwd_tol: the residual each solve stops at (None: ``tol``;
            torchbraid's ``setFwdAbsTol``/``setBwdAbsTol``).
        fine_relax: relaxation of the fine level only (None: ``relax``):
            torchbraid's ``fine_fcf=True`` is ``fine_relax="FCF"``.
        cycle_type: ``"V"`` or ``"F"`` cycles (PyMGRIT's name), both solves.

    The defaults are :class:`~mpx.mgrit.LayerParallel`'s. A class with other
    defaults says so in its ``defaults`` attribute (:class:`~mpx.mgrit.ParallelGRU`
    relaxes with FCF and runs 2 adjoint cycles); an options object is taken as it is.

    Example::

        opts = MGRITOptions(levels=3, cfactor=4, fwd_iters=2, bwd_iters=1)
        net = LayerParallel(opening, block, closing, num_steps=64, options=opts)
        gru = ParallelGRU(3, 8, options=dataclasses.replace(ParallelGRU.defaults, levels=3))
    """

    levels: int = 2
    cfactor: int | tuple[int, ...] = 2
    fwd_iters: int = 2
    bwd_iters: int = 1
    tol: float = 1e-9
    relax: str = "F"
    nrelax: int = 1
    skip_downcycle: bool = True
    fwd_levels: int | None = None
    bwd_levels: int | None = None
    fwd_tol: float | None = None
    bwd_tol: float | None = None
    fine_relax: str | None = None
    cycle_type: str = "V"

    def __post_init__(self) -> None:
        for name in ("levels", "fwd_levels", "bwd_levels"):
            value = getattr(self, name)
            if value is not None or name == "levels":
                check_int(value, name, 1, "1 = a sequential solve")
        cfactor: object = self.cfactor
        if not isinstance(cfactor, int) and not (
            isinstance(cfactor, Sequence) and not isinstance(cfactor, str)
        ):
            raise MGRITTypeError(
                f"cfactor must be an int or a sequence of ints (one per coarsening), got "
                f"cfactor={cfactor!r}; e.g. cfactor=2 or cfactor=[4, 2]"
            )
        # The deepest grid needs a factor per coarsening: checked against it, once.
        coarsening_factors(self.cfactor, max(self.forward_levels, self.adjoint_levels))
        if not isinstance(cfactor, int):
            object.__setattr__(self, "cfactor", tuple(cfactor))
        check_int(self.fwd_iters, "fwd_iters", 1, "MGRIT cycles of the forward solve")
        check_int(self.bwd_iters, "bwd_iters", 1, "MGRIT cycles of the adjoint solve")
        object.__setattr__(self, "tol", check_tol(self.tol, "tol"))
        for name in ("fwd_tol", "bwd_tol"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, check_tol(getattr(self, name), name))
        check_choice(self.relax, "relax", RELAXATIONS)
        if self.fine_relax is not None:
            check_choice(self.fine_relax, "fine_relax", RELAXATIONS, " or None (= relax)")
        check_int(self.nrelax, "nrelax", 0, "CF sweeps after the first F sweep")
        check_choice(self.cycle_type, "cycle_type", CYCLES, " (as PyMGRIT names them)")
        skip: object = self.skip_downcycle
        if not isinstance(skip, bool):
            raise MGRITTypeError(
                f"skip_downcycle must be True or False, got skip_downcycle={skip!r}"
            )

    @property
    def forward_levels(self) -> int:
        """Levels of the forward solve: ``fwd_levels``, else ``levels``."""
        return self.levels if self.fwd_levels is None else self.fwd_levels

    @property
    def adjoint_levels(self) -> int:
        """Levels of the adjoint solve: ``bwd_levels``, else ``levels``."""
        return self.levels if self.bwd_levels is None else self.bwd_levels

    @property
    def forward_tol(self) -> float:
        """The residual the forward solve stops at: ``fwd_tol``, else ``tol``."""
        return self.tol if self.fwd_tol is None else self.fwd_tol

    @property
    def adjoint_tol(self) -> float:
        """The residual the adjoint solve stops at: ``bwd_tol``, else ``tol``."""
        return self.tol if self.bwd_tol is None else self.bwd_tol

    def as_dict(self) -> dict[str, Any]:
        """The settings by name (a new dict: changing it changes nothing here)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class MGRITSettings(TypedDict, total=False):
    """:class:`MGRITOptions`' fields as keyword arguments (``**settings``), for type checkers.

    The same names and types as the dataclass (a test holds the two together).
    """

    levels: int
    cfactor: int | Sequence[int]
    fwd_iters: int
    bwd_iters: int
    tol: float
    relax: str
    nrelax: int
    skip_downcycle: bool
    fwd_levels: int | None
    bwd_levels: int | None
    fwd_tol: float | None
    bwd_tol: float | None
    fine_relax: str | None
    cycle_type: str


#: The names of MGRIT's settings, in the dataclass's order.
NAMES = tuple(f.name for f in dataclasses.fields(MGRITOptions))


def resolve(
    owner: str, options: MGRITOptions | None, settings: Mapping[str, Any], defaults: MGRITOptions
) -> MGRITOptions:
    """The options of ``owner``: ``options`` as given, or ``defaults`` with ``settings`` set.

    Raises:
        MGRITConfigError: both ``options`` and settings were given.
        MGRITTypeError: ``options`` is no MGRITOptions, or a setting is unknown.
    """
    if options is not None:
        if not isinstance(options, MGRITOptions):
            raise MGRITTypeError(
                f"{owner}: options must be an MGRITOptions, got {type(options).__name__}; "
                "write options=MGRITOptions(levels=..., ...) or pass the settings as keywords"
            )
        if settings:
            raise MGRITConfigError(
                f"{owner} got options= and the settings {sorted(settings)} as keywords: give "
                "one or the other, e.g. options=dataclasses.replace(options, "
                f"{', '.join(f'{k}=...' for k in sorted(settings))})"
            )
        return options
    unknown = sorted(set(settings) - set(NAMES))
    if unknown:
        raise MGRITTypeError(
            f"{owner} got unknown settings {unknown}; MGRIT's settings are {list(NAMES)}"
        )
    return dataclasses.replace(defaults, **settings) if settings else defaults
