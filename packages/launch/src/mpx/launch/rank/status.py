"""The status lines rank supervisors send ``mpxrun``, signed so that no output can forge one.

A supervisor reports on its rank's stderr, the one channel every launcher
forwards from every node::

    MPXRUN-RANK-EXITED <rank> <code> <base64 of the last stderr lines> <mac>
    MPXRUN-RANK-STACK  <rank> <pid>  <base64 of the stack dump lines>  <mac>
    MPXRUN-RANK-ENDED  <rank> <code> <base64 of nothing> <mac>
    MPXRUN-RANK-LEFT   <rank> 0      <base64 of the last stderr lines> <mac>

``ENDED``: the rank's Python program reached its end (it may still be in
``MPI_Finalize``); ``LEFT``: it exited 0 without reaching it (``os._exit(0)``).

``mac`` is an HMAC-SHA256 (first 128 bits) of the rest under a key ``mpxrun``
draws for each job (``MPX_STATUS_KEY``). The supervisor removes the key from
its program's environment, so a program that prints a status line (a test
suite echoing a log, a user copying one) prints one with a wrong MAC: it is
passed through as ordinary output instead of ending a healthy job. Only a
program that digs the key out of another process could forge a line, and
such a program can end the job anyway.

Example::

    key = new_key()
    line = format_status(key, "EXITED", 1, 3, ["Traceback ...", "ValueError: x"])
    parse_status(key, line)          # RankStatus("EXITED", 1, 3, [...])
    parse_status(new_key(), line)    # None: not signed by this job
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["KINDS", "RankStatus", "format_status", "new_key", "parse_status"]

KINDS = ("EXITED", "STACK", "ENDED", "LEFT")
_LINE = re.compile(
    r"MPXRUN-RANK-(EXITED|STACK|ENDED|LEFT) (\d+) (-?\d+) ([A-Za-z0-9+/=]*) ([0-9a-f]{32})"
)


@dataclass(frozen=True)
class RankStatus:
    """What a rank's supervisor reported.

    Attributes:
        kind: ``"EXITED"`` (the program ended; ``value`` is its exit code,
            negative for a signal), ``"STACK"`` (the program's Python stack,
            asked for by ``mpxrun``; ``value`` is its pid), ``"ENDED"`` (the
            Python program reached its end, exiting with ``value``; the
            process may still be finalizing MPI) or ``"LEFT"`` (it exited 0
            without reaching its end).
        rank: the rank.
        value: the exit code or the pid.
        lines: the last lines of stderr, or the stack dump.
    """

    kind: str
    rank: int
    value: int
    lines: list[str] = field(default_factory=list)


def new_key() -> str:
    """A fresh random key for one job's status lines."""
    return secrets.token_hex(16)


def _mac(key: str, body: str) -> str:
    return hmac.new(key.encode(), body.encode(), hashlib.sha256).hexdigest()[:32]


def format_status(key: str, kind: str, rank: int, value: int, lines: Sequence[str]) -> str:
    """One status line (without the newline), signed with ``key``."""
    if kind not in KINDS:
        raise ValueError(f"status kind must be one of {', '.join(KINDS)}, got {kind!r}")
    # Lines never hold a newline: joined by one, they come apart again.
    payload = base64.b64encode("\n".join(lines).encode()).decode()
    body = f"MPXRUN-RANK-{kind} {rank} {value} {payload}"
    return f"{body} {_mac(key, body)}"


def parse_status(key: str, line: str) -> RankStatus | None:
    """The status in ``line`` if it carries one signed with ``key``, else None.

    The line may have a prefix (a launcher's rank tag such as ``[1] ``).
    """
    match = _LINE.search(line)
    if match is None:
        return None
    body = match.group(0)[: -len(match.group(5)) - 1]
    if not hmac.compare_digest(_mac(key, body), match.group(5)):
        return None
    try:
        text = base64.b64decode(match.group(4)).decode()
    except ValueError:
        text = ""
    lines = text.split("\n") if text else []
    return RankStatus(match.group(1), int(match.group(2)), int(match.group(3)), lines)
