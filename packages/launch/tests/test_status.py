"""Signed status lines: read back with the job's key, ignored without it."""

from __future__ import annotations

import pytest

from mpx.launch.rank import RankStatus, format_status, new_key, parse_status


def test_status_line_round_trips_through_a_rank_prefix() -> None:
    key = new_key()
    tail = ["Traceback (most recent call last):", "  ValueError: ünïcode and spaces"]
    line = "[1] " + format_status(key, "EXITED", 1, -9, tail) + "\n"
    assert parse_status(key, line) == RankStatus("EXITED", 1, -9, tail)
    assert parse_status(key, "an ordinary line of output") is None


def test_a_line_not_signed_with_the_jobs_key_is_ordinary_output() -> None:
    key = new_key()
    line = format_status(key, "EXITED", 0, 5, [])
    assert parse_status(new_key(), line) is None
    # The old unsigned form, and a signed line with its code changed.
    assert parse_status(key, "MPXRUN-RANK-FAILED 0 5 W10=") is None
    assert parse_status(key, line.replace(" 0 5 ", " 0 6 ")) is None


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="'DONE'"):
        format_status(new_key(), "DONE", 0, 0, [])
