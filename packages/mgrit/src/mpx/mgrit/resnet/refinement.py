"""Multilevel initialisation: train a shallow network, then refine it in time.

Cyr, Guenther and Schroder (2019) train a residual network with few steps
first, then interpolate its weights to a network with more, smaller steps and
go on training; the refined network starts close to the coarse one because
both discretise the same ODE ``x' = f(t, x)`` on [0, Tf]. Here the weights are
interpolated piecewise constant in time: step k of the fine network copies
step ``k // factor`` of the coarse one::

    coarse  |   f_0    |   f_1    |   f_2    |        N steps of h
    fine    |f_0 | f_0 |f_1 | f_1 |f_2 | f_2 |        factor * N steps of h / factor
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from mpx.mgrit.errors import MGRITConfigError
from mpx.mgrit.resnet.layer_parallel import LayerParallel

__all__ = ["refine"]


def refine(net: LayerParallel, factor: int = 2, **overrides: Any) -> LayerParallel:
    """A :class:`LayerParallel` with ``factor`` times the steps, weights copied in time.

    Collective over ``net.comm``: the step layers are gathered, then each rank
    keeps the ones its new block holds. The open and close layers are copied.
    The new network is a new one to :meth:`~LayerParallel.close`; ``net`` stays open.

    Args:
        net: the trained coarse network.
        factor: how many fine steps replace each coarse step.
        overrides: MGRIT settings to change (``levels``, ``cfactor``, ``fwd_iters``...).

    Example::

        coarse = LayerParallel(opening, block, closing, num_steps=4, levels=1)
        train(coarse); fine = refine(coarse, levels=2); train(fine)
        assert fine.num_steps == 8
    """
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise MGRITConfigError(f"factor must be an int >= 1, got {factor!r}")
    names = sorted(net.options.as_dict())
    unknown = set(overrides) - set(names)
    if unknown:
        raise MGRITConfigError(
            f"refine got unknown settings {sorted(unknown)}; the settings are {names}"
        )
    options = dataclasses.replace(net.options, **overrides)  # checked as it is made
    steps = net.gather_steps()
    fine = [copy.deepcopy(steps[k // factor]) for k in range(net.num_steps * factor)]
    params = list(net.parameters())
    refined = LayerParallel(
        copy.deepcopy(net.open_layer), fine, copy.deepcopy(net.close_layer),
        net.num_steps * factor, net.Tf, comm=net.comm, options=options,
    )  # fmt: skip
    return refined.to(params[0].device) if params else refined
