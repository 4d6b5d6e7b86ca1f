"""A live state (model, optimizer, step, the loop's position) as a frame's payload, and back.

A returning replica group gets the live state from a peer in one ``STATE``
frame (see :mod:`mpx.dataparallel.recovery.links`); :func:`pack_state` cuts a
state tree into that frame's parts, :func:`unpack_state` rebuilds it on the
receiver, raising :class:`~mpx.dataparallel.recovery.links.PeerLost` on a
malformed one (the peer is then no use, as a dead one).
"""

from __future__ import annotations

import struct
from typing import Any

from mpx.dataparallel.recovery.links import PeerLost

__all__ = ["pack_state", "unpack_state"]

# -- a state's wire format: its tensors' raw bytes, not torch.save's --
#
# torch.save and torch.load of a model's and optimizer's state took most of a
# rejoin (88 ms and 118 ms for the benchmark's 10 MB on the loaded 2-core VM):
# the tensors travel as raw bytes after a small torch.save'd skeleton (the
# same tree with each tensor replaced by a marker), and the receiver's tensors
# are views of the received frame.

_TENSOR = "__mpx_ft_tensor__"
_ALIGN = 64  # every tensor's bytes start at a multiple of this (any dtype's alignment)
_LENGTH = struct.Struct("!Q")


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


_AS_IS = object()  # a leaf function's answer for "not mine: walk into it"


def _rebuilt(value: Any, leaf: Any) -> Any:
    """``value`` with ``leaf(v)`` in place of each part ``v`` it answers for (not
    :data:`_AS_IS`), dicts (an OrderedDict stays one, with a state_dict's
    ``_metadata``: load_state_dict reads it), lists and tuples walked into."""
    done = leaf(value)
    if done is not _AS_IS:
        return done
    if isinstance(value, dict):
        out = type(value)((k, _rebuilt(v, leaf)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, list | tuple):
        return type(value)(_rebuilt(v, leaf) for v in value)
    return value


def pack_state(tree: Any) -> list[memoryview]:
    """``tree`` (dicts, lists, tuples, tensors, plain values) as a frame's parts."""
    import io

    import torch

    tensors: list[torch.Tensor] = []
    offset = 0

    def strip(value: Any) -> Any:
        nonlocal offset
        if not isinstance(value, torch.Tensor):
            return _AS_IS
        tensor = value.detach().to("cpu").contiguous()
        tensors.append(tensor)
        marker = (_TENSOR, offset, str(tensor.dtype).removeprefix("torch."), *tensor.shape)
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
        return marker

    buffer = io.BytesIO()
    torch.save(_rebuilt(tree, strip), buffer)
    skeleton = buffer.getbuffer()
    parts = [memoryview(_LENGTH.pack(len(skeleton))), skeleton]
    at = _LENGTH.size + len(skeleton)
    start = _aligned(at)  # where the tensors' bytes begin: their offsets count from here
    for tensor in tensors:
        parts.append(memoryview(bytes(_aligned(at) - at)))
        at = _aligned(at)
        if tensor.numel():
            parts.append(tensor.view(-1).view(torch.uint8).numpy().data.cast("B"))
        at += tensor.numel() * tensor.element_size()
    assert at - start <= offset
    return parts


def unpack_state(payload: bytearray | memoryview, device: Any) -> Any:
    """:func:`pack_state`'s tree back; its CPU tensors are views of ``payload``."""
    import io

    import torch

    try:
        (length,) = _LENGTH.unpack_from(payload)
        skeleton = memoryview(payload)[_LENGTH.size : _LENGTH.size + length]
        tree = torch.load(io.BytesIO(skeleton), map_location="cpu", weights_only=True)
    except Exception as exc:  # whatever torch.load raises on junk: the peer is no use
        raise PeerLost(f"a peer sent a malformed state: {exc}") from exc
    data = torch.frombuffer(payload, dtype=torch.uint8)[_aligned(_LENGTH.size + length) :]

    def dress(value: Any) -> Any:
        if not (isinstance(value, tuple) and value[:1] == (_TENSOR,)):
            return _AS_IS
        _, offset, dtype, *shape = value
        kind = getattr(torch, str(dtype), None)
        if not isinstance(kind, torch.dtype):
            raise PeerLost(f"a peer's state named no dtype: {dtype!r}")
        count = 1
        for n in shape:
            count *= n
        nbytes = count * torch.empty(0, dtype=kind).element_size()
        return data[offset : offset + nbytes].view(kind).view(shape).to(device)

    try:
        return _rebuilt(tree, dress)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise PeerLost(f"a peer sent a malformed state: {exc}") from exc
