"""The rank supervisor: ``python -m mpx.launch.rank -- prog args…``, once per rank.

The MPI launcher starts it in place of the program; it starts the program,
binds it to its cores (``MPX_BIND``), forwards its output and signals, and
tells ``mpxrun`` how it ended in lines only the two can sign.

What lives here: ``supervisor`` (:func:`main`, :func:`rank_environment` and
the variables torch and Open MPI get, :func:`die_with_parent`,
:func:`usable_cores`), ``binding`` (:func:`cpus_for`: the cores or NUMA node
of a local rank) and ``status`` (the signed status lines: written here, read
by ``mpxrun``; :func:`new_key`). ``__main__`` runs :func:`main`.

What it may import: the hook (``mpx.launch.hook``, for the stack dumps)
through its ``__init__``, ``environment``, ``settings`` and ``errors``. Not
``mpxrun``'s side (``mpx.launch.supervision``, ``.command``, ``.recovery``,
``mpx.launch.cli``), which builds on this one.
"""

from mpx.launch.rank.binding import BIND_LEVELS, cpus_for
from mpx.launch.rank.status import KINDS, RankStatus, format_status, new_key, parse_status
from mpx.launch.rank.supervisor import (
    die_with_parent,
    main,
    rank_environment,
    torchrun_variables,
    usable_cores,
)

__all__ = [
    "BIND_LEVELS",
    "KINDS",
    "RankStatus",
    "cpus_for",
    "die_with_parent",
    "format_status",
    "main",
    "new_key",
    "parse_status",
    "rank_environment",
    "torchrun_variables",
    "usable_cores",
]
