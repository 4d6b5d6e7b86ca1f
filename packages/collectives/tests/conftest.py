"""Fixtures shared by the collectives tests: torch on the ``mpx`` backend, and the
ring neighbours and one-rank communicator of the Channel tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch.distributed as dist

    from mpx.collectives import Communicator

__all__ = ["groups", "ring", "self_comm"]


@pytest.fixture
def ring() -> tuple[Communicator, int, int]:
    """The world and this rank's neighbours (right = rank + 1, left = rank - 1, modulo
    the size): on 1 rank both are the rank itself, so a test runs alike at any size."""
    from mpx.collectives import world  # imported by the tests that use it, as groups does

    comm = world()
    return comm, (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size


@pytest.fixture
def self_comm() -> Communicator:
    """A communicator of this rank alone (a split of the world by rank)."""
    from mpx.collectives import world

    comm = world().split(world().rank)
    assert comm is not None
    return comm


@pytest.fixture(scope="module")
def groups() -> Iterator[dict[str, dist.ProcessGroup]]:
    """The default group on mpx (env:// store) and a gloo group over the same ranks.

    Module-scoped: each module that asks for it makes the default group once
    and destroys it after its last test.
    """
    import torch.distributed as dist  # only the modules that use it pay for torch

    from mpx.collectives import init_process_group
    from mpx.launch import init_torch_env

    init_torch_env()
    init_process_group("env://")
    gloo = dist.new_group(backend="gloo")
    default = dist.group.WORLD
    assert default is not None
    yield {"mpx": default, "gloo": gloo}
    dist.destroy_process_group()
