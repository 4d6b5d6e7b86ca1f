"""mpxrun's side of a job: it starts the launcher, watches the ranks and says how it ended.

What lives here: ``job`` (:class:`Job`: the launcher's process, the status
lines the rank supervisors sign, the first failure, ``--timeout`` and the
stacks it asks for, the stop of every rank; mpxrun's exit codes
:data:`EXIT_TIMEOUT` and :data:`EXIT_USAGE`), ``outcome`` (the attempts
``--max-restarts`` allows, the report and exit code of the last one) and
``shm_cleanup`` (the MPI shared-memory segments a failed job left behind).

What it may import: the rank supervisor (``mpx.launch.rank``: its status
lines, :func:`die_with_parent`) and the hook (``mpx.launch.hook``: the stack
dumps), each through its ``__init__``; ``settings`` and ``errors``. Not the
command line (``mpx.launch.command``) nor the replica groups
(``mpx.launch.recovery``), which build on this one.
"""

from mpx.launch.supervision import shm_cleanup
from mpx.launch.supervision.job import (
    EXIT_ENDED_EARLY,
    EXIT_TIMEOUT,
    EXIT_USAGE,
    Job,
    RankFailure,
    ranks_phrase,
)
from mpx.launch.supervision.outcome import (
    failure_of,
    report,
    run_and_clean,
    run_attempts,
    stop_on_signals,
    usage_error,
)

__all__ = [
    "EXIT_ENDED_EARLY",
    "EXIT_TIMEOUT",
    "EXIT_USAGE",
    "Job",
    "RankFailure",
    "failure_of",
    "ranks_phrase",
    "report",
    "run_and_clean",
    "run_attempts",
    "shm_cleanup",
    "stop_on_signals",
    "usage_error",
]
