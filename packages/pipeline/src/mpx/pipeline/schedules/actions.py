"""What a schedule is made of: actions, which print and parse back, and where stages live.

An :class:`Action` prints as torch.distributed.pipelining's do:
``{stage}{kind}{micro-batch}``, so ``2F0`` is the forward of micro-batch 0 on
virtual stage 2 and ``1SEND_B3`` the send of micro-batch 3's input gradient
from stage 1. :meth:`Action.parse` reads that back, and :func:`parse_actions`
a whole list written with spaces between its actions, so a test can state an
expected list as text::

    assert format_actions(rank_actions("1f1b", 0, 2, 2)) == "0F0 0SEND_F0 0F1 0SEND_F1 ..."

Virtual stages sit on ranks in a loop (stage ``s`` on rank ``s mod p``) or in
a V (:func:`rank_of`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mpx.pipeline.errors import PipelineValueError

__all__ = [
    "COMPUTE",
    "KINDS",
    "Action",
    "Op",
    "PassCosts",
    "format_actions",
    "local_stages",
    "parse_actions",
    "rank_of",
]

COMPUTE = ("F", "B", "I", "W")
"""The compute actions: forward, full backward, input gradient, weight gradient."""

KINDS = (*COMPUTE, "SEND_F", "RECV_F", "SEND_B", "RECV_B", "STEP")
"""Every kind of action an executor runs (``STEP``: an optimizer step of the
asynchronous stream)."""

PassCosts = Mapping[str, Sequence[float]]
"""The time of each virtual stage's passes: ``{"F": [...], "I": [...], "W": [...]}``, one
entry per virtual stage, in any unit (see :func:`mpx.pipeline.schedules.compute_actions`)."""

Op = tuple[str, int]
"""``("F", j)`` or ``("B", j)``: a forward or backward pass of micro-batch ``j``."""

# The longest kinds first, so that ``SEND_F`` is never read as a stage number
# followed by something else; a stage may be -1 (a rank's STEP).
_TEXT = re.compile(
    r"(-?\d+)(" + "|".join(sorted(KINDS, key=len, reverse=True)) + r")(\d+)",
)


@dataclass(frozen=True)
class Action:
    """One entry of a rank's list: ``kind`` of micro-batch ``mb`` on virtual stage ``stage``.

    ``STEP`` has ``mb`` = the backwards done when it runs and ``stage`` = the
    chunk that steps (-1: the rank's one stage).
    """

    kind: str
    mb: int
    stage: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.mb}"

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action ``str(action)`` printed: ``"2F0"``, ``"1SEND_B3"``, ``"-1STEP4"``.

        Raises:
            PipelineValueError: ``text`` is not stage, kind and micro-batch.
        """
        found = _TEXT.fullmatch(text.strip())
        if found is None:
            raise PipelineValueError(
                f"action {text!r} is not <stage><kind><micro-batch> with a kind of "
                f"{', '.join(KINDS)} (e.g. '2F0': stage 2's forward of micro-batch 0)"
            )
        stage, kind, mb = found.groups()
        return cls(kind, int(mb), int(stage))


def format_actions(actions: Iterable[Action]) -> str:
    """The actions printed with a space between them (:func:`parse_actions` reads it back)."""
    return " ".join(map(str, actions))


def parse_actions(text: str) -> list[Action]:
    """The actions of :func:`format_actions`'s text (any whitespace between them).

    Raises:
        PipelineValueError: an entry that is not an action (named in the message).
    """
    return [Action.parse(word) for word in text.split()]


def rank_of(stage: int, ranks: int, style: str) -> int:
    """The rank that runs virtual ``stage`` (``style``: ``"loop"`` or ``"v"``)."""
    if style == "v":
        return stage if stage < ranks else 2 * ranks - 1 - stage
    return stage % ranks


def local_stages(rank: int, ranks: int, v: int, style: str) -> list[int]:
    """The virtual stages of ``rank``, in the order of its chunks."""
    return [s for s in range(ranks * v) if rank_of(s, ranks, style) == rank]
