"""Fixtures shared by the collectives tests that run torch on the ``mpx`` backend."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["groups"]


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
