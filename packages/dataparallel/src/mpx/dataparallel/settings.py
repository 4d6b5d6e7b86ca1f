"""mpx-dataparallel's environment variables, declared once (the table is mpx-launch's).

``mpxrun --settings`` lists them with every other package's and reports a bad
value as the program would. Live recovery's other variables (``MPX_LIGHTHOUSE``,
``MPX_REPLICA_GROUP``...) are mpx-launch's: ``mpxrun --replica-groups`` sets them.

Example::

    from mpx.dataparallel import settings
    settings.FT_SHM.get()     # True, or MPX_FT_SHM=0 -> False
"""

from __future__ import annotations

from mpx.launch.settings import declare

__all__ = ["FT_SHM"]

_PACKAGE = "dataparallel"

FT_SHM = declare(
    "MPX_FT_SHM",
    "bool",
    True,
    "live recovery: replica groups on one host exchange gradients through shared memory "
    "where both ends can map each other's segment; 0 sends them over TCP instead",
    package=_PACKAGE,
)
