"""Time steps one after another: the loops MGRIT cannot batch.

The coarsest level is solved sequentially (``u_i = g_i + Phi(u_{i-1})``, passed
from rank to rank), and a boundary step (see :mod:`mpx.mgrit.solver.boundaries`) is one
step of one state. Both call the user's step in whichever form it takes: scalar
``step(u, t, dt)``, vectorized (a batch of states with tensors ``t``, ``dt``),
or ``step_into`` (written into the next row, no result to copy). The loops keep
to lists of rows and times: no tensor indexing per step (the hot loop of a
layer-parallel network's coarsest level).

Example::

    rows = march(step, True, ts, dts, u[0], g, n)       # rows 1..n of a level
    s = step_once(step, None, True, u_last, t, dt)      # one state's step
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["march", "march_into", "step_once"]


def march(
    step: Callable[[torch.Tensor, Any, Any], torch.Tensor],
    vectorized: bool,
    ts: Sequence[Any],
    dts: Sequence[Any],
    x: torch.Tensor,
    g: torch.Tensor | None,
    n: int,
    begin: int = 0,
) -> torch.Tensor:
    """Rows ``begin + 1 .. n`` stepped one after another from ``x`` (row ``begin``), each
    plus its row of ``g`` (rows ``0..n``; None: zero). ``ts``/``dts``: row i's time and step."""
    out = []
    if vectorized:
        gs = None if g is None else g[1:].unsqueeze(1).unbind(0)
        y = x.unsqueeze(0)
        for i in range(begin, n):
            y = step(y, ts[i], dts[i])
            if gs is not None:
                y = gs[i] + y
            out.append(y)
        return torch.cat(out) if out else x.new_zeros((0, *x.shape))
    grows = None if g is None else g[1:].unbind(0)
    for i in range(begin, n):
        x = step(x, ts[i], dts[i])
        if grows is not None:
            x = grows[i] + x
        out.append(x)
    return torch.stack(out) if out else x.new_zeros((0, *x.shape))


def march_into(
    into: Callable[[torch.Tensor, Any, Any, torch.Tensor], None],
    ts: Sequence[Any],
    dts: Sequence[Any],
    u: torch.Tensor,
    g: torch.Tensor | None,
    n: int,
    begin: int = 0,
) -> None:
    """:func:`march` with ``step_into``: each step written into the next row of ``u``."""
    rows = u.unsqueeze(1).unbind(0)  # views of one row each
    gs = None if g is None else g.unsqueeze(1).unbind(0)
    for i in range(begin, n):
        into(rows[i], ts[i], dts[i], rows[i + 1])
        if gs is not None:
            rows[i + 1].add_(gs[i + 1])


def step_once(
    step: Callable[[torch.Tensor, Any, Any], torch.Tensor],
    into: Callable[[torch.Tensor, Any, Any, torch.Tensor], None] | None,
    vectorized: bool,
    row: torch.Tensor,
    t: float,
    dt: float,
) -> torch.Tensor:
    """One step of one state from time ``t``, in the form the step takes."""
    if not vectorized:
        return step(row, t, dt)
    tt = torch.tensor([t], dtype=torch.float64, device=row.device)
    tdt = torch.tensor([dt], dtype=torch.float64, device=row.device)
    x = row.unsqueeze(0)
    if into is None:
        return step(x, tt, tdt)[0]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    into(x, tt, tdt, out)
    return out[0]
