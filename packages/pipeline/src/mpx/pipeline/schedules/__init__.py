"""Schedules as data: which passes each rank runs, in what order; nothing here runs one.

What lives here: ``table`` (:data:`TABLE`, every schedule declared once: its
name, torch's name, placement, chunks per rank, split backward, timed,
asynchronous, generator; :func:`rank_actions`, a rank's list of actions,
sends and receives included; :func:`grid` and :func:`bubble_fraction`),
``actions`` (an :class:`Action`, which prints and parses back as torch's do,
``2F0``, and where virtual stages sit), ``orders`` (each schedule's generator
of compute actions), ``zero_bubble`` (the list scheduler ``interleaved_zb``
and ``zbv`` are laid out by), ``async_layout`` (the asynchronous stream, call
after call) and ``timing`` (lists timed against the data dependencies, drawn
as grids; the grid of a failed call). Pure Python over lists: no torch, no MPI.

What it may import: ``mpx.pipeline.errors`` only. ``runtime`` runs what this
role lays out, and the ``Pipeline`` asks its table; both through this
``__init__``.
"""

from mpx.pipeline.schedules.table import (
    ALIASES,
    COMPUTE,
    SCHEDULES,
    SPLIT,
    TABLE,
    TIMED,
    Action,
    AsyncLayout,
    Chunks,
    Op,
    PassCosts,
    Schedule,
    async_actions,
    async_flush_actions,
    async_ops,
    bubble_fraction,
    canonical,
    compute_actions,
    flush_ops,
    format_actions,
    grid,
    local_stages,
    max_alive,
    parse_actions,
    placement,
    rank_actions,
    rank_of,
    simulate,
    spec,
    stage_ops,
    stages_per_rank,
    timeline,
)
from mpx.pipeline.schedules.timing import stopped_grid

__all__ = [
    "ALIASES",
    "COMPUTE",
    "SCHEDULES",
    "SPLIT",
    "TABLE",
    "TIMED",
    "Action",
    "AsyncLayout",
    "Chunks",
    "Op",
    "PassCosts",
    "Schedule",
    "async_actions",
    "async_flush_actions",
    "async_ops",
    "bubble_fraction",
    "canonical",
    "compute_actions",
    "flush_ops",
    "format_actions",
    "grid",
    "local_stages",
    "max_alive",
    "parse_actions",
    "placement",
    "rank_actions",
    "rank_of",
    "simulate",
    "spec",
    "stage_ops",
    "stages_per_rank",
    "stopped_grid",
    "timeline",
]
