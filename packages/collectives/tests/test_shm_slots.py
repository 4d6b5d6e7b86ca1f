"""The shm slot size: cache-sized pieces unless the host is oversubscribed or the user chose."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mpx.collectives.impl import shm as impl_shm
from mpx.launch.settings import reload as reload_settings


@pytest.fixture(autouse=True)
def _fresh_settings(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("MPX_SHM_SLOT_MB", raising=False)
    reload_settings()
    yield
    # Torn down before monkeypatch restores the environment: drop a test's
    # value now, so that no later test reads it from the settings cache.
    monkeypatch.delenv("MPX_SHM_SLOT_MB", raising=False)
    reload_settings()


def test_unset_slots_are_cache_sized_where_every_rank_has_a_core() -> None:
    assert impl_shm.slot_bytes(oversubscribed=False) == 2 << 20


def test_unset_slots_keep_the_default_where_ranks_outnumber_cores() -> None:
    assert impl_shm.slot_bytes(oversubscribed=True) == 16 << 20


@pytest.mark.parametrize("oversubscribed", [False, True])
def test_a_chosen_slot_size_is_kept_either_way(
    monkeypatch: pytest.MonkeyPatch, oversubscribed: bool
) -> None:
    monkeypatch.setenv("MPX_SHM_SLOT_MB", "8")
    reload_settings()
    assert impl_shm.slot_bytes(oversubscribed) == 8 << 20
