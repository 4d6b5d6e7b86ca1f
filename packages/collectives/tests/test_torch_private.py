"""torch's private APIs are used by one module of mpx-collectives: ``_torch_private``.

A private name of torch may change in any release of torch; kept in one
module, a change of torch breaks one module, which says what it relies on.
"""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from mpx.collectives.base import _torch_private
from mpx.collectives.base._torch_private import on_builtin_comm_hook

# torch's private names that mpx-collectives relies on (see _torch_private's docstring).
PRIVATE_TORCH_NAMES = [
    "_register_builtin_comm_hook",
    "_share_cuda_",
    "_new_shared_cuda",
    "_Options",
    "create_device",  # gloo's transport device, ProcessGroupGloo.create_device
]
# The package's every module, in every subpackage.
SOURCES = Path(_torch_private.__file__).parents[1]


def _names_in_code(path: Path) -> set[str]:
    """The attribute and variable names ``path``'s code uses (not its docstrings or comments)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Name):
            names.add(node.id)
    return names


@pytest.mark.parametrize("name", PRIVATE_TORCH_NAMES)
def test_private_torch_names_appear_only_in_torch_private(name: str) -> None:
    users = sorted(
        str(path.relative_to(SOURCES))
        for path in SOURCES.rglob("*.py")
        if path.name != "_torch_private.py" and name in _names_in_code(path)
    )
    assert users == [], f"{name} used outside _torch_private.py, in {users}"
    assert name in _names_in_code(SOURCES / "base" / "_torch_private.py")


def test_builtin_comm_hook_listeners_hear_the_group_before_torch_registers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ddp_class: Any = torch.nn.parallel.DistributedDataParallel
    registered: list[tuple[str, Any]] = []

    def torchs(self: Any, comm_hook_type: Any) -> None:
        registered.append((self.process_group, comm_hook_type))

    monkeypatch.setattr(ddp_class, "_register_builtin_comm_hook", torchs)
    monkeypatch.setattr(_torch_private, "_HOOK_LISTENERS", [])
    heard: list[Any] = []

    def listener(group: Any) -> None:
        assert registered == []  # before torch's own registration
        heard.append(group)

    on_builtin_comm_hook(listener)
    on_builtin_comm_hook(listener)  # idempotent: neither heard nor wrapped twice
    ddp = SimpleNamespace(process_group="the group")
    ddp_class._register_builtin_comm_hook(ddp, "FP16_COMPRESS")
    assert heard == ["the group"]
    assert registered == [("the group", "FP16_COMPRESS")]
