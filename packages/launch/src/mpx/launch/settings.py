"""The one table of ``MPX_*`` environment variables, and the one way to read them.

Every variable any mpx package reads is declared once, in its package's
``settings`` module, with a type, a unit, a default and one line of doc::

    COLLECTIVES_IMPL = declare("MPX_COLLECTIVES_IMPL", "choice", "auto",
                               "implementation every collective uses", choices=(...))
    COLLECTIVES_IMPL.get()      # parsed, validated, cached: "auto"

This module lives in mpx-launch because mpx-launch is the dependency-free
bottom of the stack (no torch, no MPI): every other package can build on it,
and ``mpxrun`` can validate a job's variables before starting any rank.

Values are read from the environment once, at first use, and cached (a
collective reads its settings on every call; ``os.environ`` lookups would
cost a fifth of MPI's small-message latency). A program that changes
``os.environ`` later calls :func:`reload` to have it seen.

Kinds and the forms they accept::

    kind     accepts                                   e.g.
    -------  ----------------------------------------  ---------------------
    bool     1 0 true false yes no on off (any case)   MPX_CHECK=1
    int      a decimal integer                         MPX_RANKS_PER_NODE=2
    float    a decimal number                          MPX_FOO=0.5
    seconds  a positive number of seconds; empty: no   MPX_TIMEOUT=30
             limit (None)
    size     bytes, or a number with K, M, G, T         MPX_AUTO_SMALL_BYTES=256K
             (binary: 1K = 1024; KiB, MB... accepted);
             a bare number is in the setting's unit
    choice   one of the declared names                 MPX_COLLECTIVES_IMPL=shm
    str      anything                                  MPX_POLICY_FILE=/tmp/p.json

A malformed value raises :class:`SettingError` (a ``ValueError``) naming the
variable, the value and the accepted form.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, Generic, Literal, TypeVar

from mpx.launch.errors import SettingError

__all__ = [
    "Setting",
    "SettingError",
    "all_settings",
    "check_environment",
    "declare",
    "format_size",
    "load_declarations",
    "markdown_table",
    "parse_size",
    "reload",
]

T = TypeVar("T")
Kind = Literal["bool", "int", "float", "seconds", "size", "choice", "str"]

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_UNIT_BYTES = {"bytes": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}

# Where the table lives: name -> Setting (every package's declarations).
_TABLE: dict[str, Setting[Any]] = {}


def parse_size(text: str, unit: str = "bytes") -> int:
    """Bytes in ``"64K"``, ``"1M"``, ``"2G"``, ``"1.5MiB"``; a bare number is in ``unit``.

    Raises:
        ValueError: the text is not such a size.
    """
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{text!r} is not a size")
    number, suffix = match.groups()
    scale = _SCALE[suffix.upper()] if suffix else _UNIT_BYTES[unit]
    return int(float(number) * scale)


def format_size(nbytes: int) -> str:
    """``64K``, ``16M``, ``2G``: the shortest exact form :func:`parse_size` reads back."""
    for suffix in ("T", "G", "M", "K"):
        scale = _SCALE[suffix]
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{suffix}"
    return str(nbytes)


def _accepted(setting: Setting[Any]) -> str:
    if setting.kind == "bool":
        return "1/0, true/false, yes/no or on/off"
    if setting.kind == "int":
        return "an integer"
    if setting.kind == "float":
        return "a number"
    if setting.kind == "seconds":
        return "a positive number of seconds, or empty for no limit"
    if setting.kind == "size":
        bare = "bytes" if setting.unit == "bytes" else setting.unit
        return f"a size such as 64K, 1M or 2G (a bare number is in {bare})"
    if setting.kind == "choice":
        return "one of " + ", ".join(setting.choices)
    return "any text"


@dataclass(eq=False)
class Setting(Generic[T]):
    """One environment variable: how to parse it, its default, what it is for.

    Attributes:
        name: the variable (``MPX_...``).
        kind: how its text is parsed (see the module's table).
        default: the value when unset or empty.
        doc: one line for the docs' table.
        package: the mpx package that reads it.
        unit: for sizes, the unit of a bare number; for others, a word for the docs.
        choices: for ``choice``, the accepted names.
        minimum: smallest accepted value (numbers and sizes).
        aliases: other names read when ``name`` is unset (first found wins).
        when: ``"run"`` (read by the program) or ``"build"`` (read when installing).
    """

    name: str
    kind: Kind
    default: T
    doc: str
    package: str
    unit: str = ""
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    aliases: tuple[str, ...] = ()
    when: str = "run"
    _cached: Any = field(default=None, repr=False)
    _loaded: bool = field(default=False, repr=False)

    def raw(self, env: Mapping[str, str] | None = None) -> tuple[str, str] | None:
        """``(variable, text)`` of the first of name and aliases that is set, non-empty."""
        source = os.environ if env is None else env
        for key in (self.name, *self.aliases):
            text = source.get(key)
            if text is not None and text.strip():
                return key, text.strip()
        return None

    def parse(self, text: str, variable: str | None = None) -> T:
        """The value of ``text``; SettingError names the variable and the accepted form."""
        variable = variable or self.name
        try:
            value = self._convert(text)
        except ValueError:
            raise SettingError(
                f"{variable}={text!r} is not valid: expected {_accepted(self)}"
                f" (unset it for the default, {self.default!r})"
            ) from None
        if self.minimum is not None and isinstance(value, (int, float)) and value < self.minimum:
            raise SettingError(
                f"{variable}={text!r} is too small: it must be at least {self.minimum:g}"
                f"{' bytes' if self.kind == 'size' else ''}"
            )
        return value  # type: ignore[no-any-return]

    def _convert(self, text: str) -> Any:
        if self.kind == "bool":
            low = text.lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(text)
        if self.kind == "int":
            return int(text)
        if self.kind == "float":
            return float(text)
        if self.kind == "seconds":
            value = float(text)
            if not value > 0:
                raise ValueError(text)
            return value
        if self.kind == "size":
            return parse_size(text, self.unit or "bytes")
        if self.kind == "choice":
            if text not in self.choices:
                raise ValueError(text)
            return text
        return text

    def read(self, env: Mapping[str, str] | None = None) -> T:
        """Parses the variable from ``env`` (``os.environ`` by default), uncached."""
        found = self.raw(env)
        return self.default if found is None else self.parse(found[1], found[0])

    def get(self) -> T:
        """The value from ``os.environ``, read at first use and cached (see :func:`reload`)."""
        if not self._loaded:
            self._cached = self.read()
            self._loaded = True
        return self._cached  # type: ignore[no-any-return]

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        return self.raw(env) is not None


def declare(
    name: str,
    kind: Kind,
    default: T,
    doc: str,
    *,
    package: str,
    unit: str = "",
    choices: tuple[str, ...] = (),
    minimum: float | None = None,
    aliases: tuple[str, ...] = (),
    when: str = "run",
) -> Setting[T]:
    """Declares one variable in the table; declaring a name twice is an error."""
    if name in _TABLE:
        raise SettingError(f"{name} is declared twice (by {_TABLE[name].package} and {package})")
    setting = Setting(name, kind, default, doc, package, unit, choices, minimum, aliases, when)
    _TABLE[name] = setting
    return setting


def all_settings() -> list[Setting[Any]]:
    """Every declared variable so far, ordered by package then name."""
    return sorted(_TABLE.values(), key=lambda s: (s.package, s.name))


_reload_hooks: list[Callable[[], None]] = []


def on_reload(hook: Callable[[], None]) -> None:
    """Runs ``hook`` after every :func:`reload` (caches built from settings drop themselves)."""
    _reload_hooks.append(hook)


def reload() -> None:
    """Forgets every cached value: the next read sees ``os.environ`` as it is now."""
    for setting in _TABLE.values():
        setting._loaded = False
        setting._cached = None
    for hook in _reload_hooks:
        hook()


# mpx packages list their settings module under this entry-point group, so
# the docs' table covers whatever is installed without launch knowing them.
ENTRY_POINT_GROUP = "mpx.settings"


def load_declarations() -> list[str]:
    """Imports every installed package's settings module; returns their names."""
    loaded = []
    # Imported here: importlib.metadata costs every process that reads a
    # setting (every rank under mpxrun, through its exit hook) ~0.1 s.
    import importlib.metadata

    for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        importlib.import_module(entry.value)
        loaded.append(entry.value)
    return sorted(loaded)


def _iter_rows(settings: list[Setting[Any]]) -> Iterator[str]:
    yield "| variable | package | type | default | meaning |"
    yield "|---|---|---|---|---|"
    for s in settings:
        kind = s.kind if s.kind != "size" else f"size ({s.unit or 'bytes'})"
        if s.kind == "choice":
            kind = "one of " + ", ".join(f"`{c}`" for c in s.choices)
        default = "unset" if s.default in (None, "") else f"`{s.default}`"
        if isinstance(s.default, bool):
            default = f"`{int(s.default)}`"
        elif s.kind == "size" and isinstance(s.default, int):
            default = f"`{format_size(s.default)}`"
        doc = s.doc
        if s.aliases:
            doc += " (also read as " + ", ".join(f"`{a}`" for a in s.aliases) + ")"
        if s.when != "run":
            doc += f" (read at {s.when} time)"
        yield f"| `{s.name}` | {s.package} | {kind} | {default} | {doc} |"


def markdown_table() -> str:
    """The docs' table of every variable of the installed packages."""
    load_declarations()
    return "\n".join(_iter_rows(all_settings())) + "\n"


def check_environment(out: IO[str]) -> int:
    """Validates every ``MPX_*`` variable set here; prints each problem; 1 if one is bad."""
    load_declarations()
    bad = 0
    for s in all_settings():
        try:
            s.read()
        except SettingError as exc:
            print(exc, file=out)
            bad += 1
    for key in sorted(k for k in os.environ if k.startswith("MPX_") and k not in _TABLE):
        print(f"{key} is set but no installed mpx package reads it", file=out)
    return 1 if bad else 0


# -- mpx-launch's own variables (mpxrun and the rank supervisor set all but MPX_LAUNCHER) --

LAUNCHER = declare(
    "MPX_LAUNCHER",
    "str",
    "auto",
    "which MPI launcher mpxrun drives: auto, mpich, openmpi, slurm, or a launcher's path",
    package="launch",
)
GPUS = declare(
    "MPX_GPUS",
    "choice",
    "auto",
    "GPUs per rank: one per local rank, round robin (auto), or none (set by mpxrun --gpus)",
    package="launch",
    choices=("auto", "none"),
)
JOB_ID = declare(
    "MPX_JOB_ID",
    "str",
    "",
    "set by mpxrun in every rank: marks a process as part of an mpxrun job",
    package="launch",
)
MASTER_ADDR = declare(
    "MPX_MASTER_ADDR",
    "str",
    "",
    "address torch.distributed rendezvous uses (set by mpxrun; MASTER_ADDR wins if set)",
    package="launch",
)
MASTER_PORT = declare(
    "MPX_MASTER_PORT",
    "str",
    "",
    "port torch.distributed rendezvous uses (set by mpxrun; MASTER_PORT wins if set)",
    package="launch",
)
STATUS_KEY = declare(
    "MPX_STATUS_KEY",
    "str",
    "",
    "set by mpxrun for the rank supervisors: the per-job key that signs their status lines "
    "(hidden from the ranks' programs, so their output cannot forge one)",
    package="launch",
)
STACK_FILE = declare(
    "MPX_STACK_FILE",
    "str",
    "",
    "set by the rank supervisor: where the rank's Python stack is written on SIGUSR1 "
    "(mpxrun --timeout asks for it before stopping the job)",
    package="launch",
)
END_FILE = declare(
    "MPX_END_FILE",
    "str",
    "",
    "set by the rank supervisor: where the rank's Python program says it started and that it "
    "reached its end (mpxrun tells a rank that returned from its program from one that left "
    "mid-run with os._exit(0), and names a rank that ended while its peers wait for it)",
    package="launch",
)
END_GRACE = declare(
    "MPX_END_GRACE",
    "float",
    30.0,
    "once a rank has ended, how long the ranks still running may wait in a collective without "
    "progress before mpxrun stops the job and names the rank that ended early (uneven step "
    "counts); ranks still working are never stopped",
    package="launch",
    unit="s",
    minimum=0.1,
)
BIND = declare(
    "MPX_BIND",
    "choice",
    "none",
    "set by mpxrun --bind where the launcher cannot bind (MPICH's gforker): the rank "
    "supervisor pins its program to one core or NUMA node per local rank, round robin",
    package="launch",
    choices=("none", "core", "numa"),
)
REPLICA_GROUP = declare(
    "MPX_REPLICA_GROUP",
    "int",
    0,
    "set by mpxrun --replica-groups in every rank: its replica group (0..R-1)",
    package="launch",
)
REPLICA_GROUPS = declare(
    "MPX_REPLICA_GROUPS",
    "int",
    1,
    "set by mpxrun --replica-groups in every rank: the number of replica groups R",
    package="launch",
)
LIGHTHOUSE = declare(
    "MPX_LIGHTHOUSE",
    "str",
    "",
    "set by mpxrun --replica-groups in every rank: host:port of the lighthouse that keeps "
    "the groups' membership (mpx.dataparallel.FaultTolerantOptimizer connects to it)",
    package="launch",
)
JOB_SECRET = declare(
    "MPX_JOB_SECRET",
    "str",
    "",
    "set by mpxrun --replica-groups in every rank: the job's secret (64 hex digits), which "
    "every connection to the lighthouse and between groups proves it holds (never sent)",
    package="launch",
)
HEARTBEAT_TIMEOUT = declare(
    "MPX_FT_HEARTBEAT_TIMEOUT",
    "float",
    0.5,
    "seconds a rank of a replica group may miss its heartbeats before the lighthouse counts "
    "its group out, at least: the group's own recent beat gaps and step times stretch it "
    "(a killed process is seen at once, by its closed connection)",
    package="launch",
)
HANG_TIMEOUT: Setting[float | None] = declare(
    "MPX_FT_HANG_TIMEOUT",
    "float",
    None,
    "seconds a replica group counted out for missed heartbeats may stay silent before "
    "mpxrun stops and restarts it as hung (default: the larger of 30 s and 20 heartbeat "
    "timeouts); a group that beats again before then rejoins on its own",
    package="launch",
    unit="s",
    minimum=0.1,
)
TORCH_ENV = declare(
    "MPX_TORCH_ENV",
    "str",
    "",
    "set by mpxrun in every rank: the torchrun variables (RANK, ...) it exported, which "
    "an mpxrun started inside the job replaces",
    package="launch",
)
RESTART_COUNT = declare(
    "MPX_RESTART_COUNT",
    "int",
    0,
    "set by mpxrun in every rank: how many times --max-restarts has restarted the job so far "
    "(0 on the first attempt; TORCHELASTIC_RESTART_COUNT carries the same number)",
    package="launch",
    minimum=0,
)
OUTPUT_FDS = declare(
    "MPX_OUTPUT_FDS",
    "str",
    "",
    "set by mpxrun for the rank supervisors of a gforker job: the two inherited descriptors "
    "(OUT,ERR) they write their rank's output to, past gforker, which cuts output at the "
    "first non-ASCII byte",
    package="launch",
)
TAG_OUTPUT = declare(
    "MPX_TAG_OUTPUT",
    "bool",
    False,
    "set by mpxrun --tag-output for MPICH (Hydra tags each write, cutting lines; gforker "
    "does not tag): the rank supervisor prefixes each whole line with [rank]",
    package="launch",
)
