"""The self-test behind ``mpxrun --check`` passes on a healthy installation, any rank count."""

from __future__ import annotations

import pytest

from mpx.collectives import selftest

pytestmark = pytest.mark.mpi


def test_selftest_passes(capsys: pytest.CaptureFixture[str]) -> None:
    assert selftest.main() == 0
