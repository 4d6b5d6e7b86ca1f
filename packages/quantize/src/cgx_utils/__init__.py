"""CGX's ``cgx_utils`` module, installed by mpx-quantize: ``CGXState`` and ``cgx_hook``.

A CGX compatibility shim over mpx.quantize: the import name is CGX's (the
module of its pip package, hence a top-level package beside ``mpx``); the hook
hands the layers to ``torch_cgx`` and reads mpx.quantize's settings. Nothing in
mpx imports it.

Written from CGX's documented behaviour (IST-DASLab/torch_cgx's README and
example; none of its code). A DDP comm hook that gives the ``"cgx"`` group each
bucket's layers, so that small and one-dimensional layers (biases, batch norm)
go exact and the others at the chosen bits::

    import torch_cgx
    from cgx_utils import CGXState, cgx_hook

    dist.init_process_group("cgx", init_method="env://")
    model = DDP(model)
    state = CGXState(dist.group.WORLD, layer_min_size=1024,
                     compression_params={"bits": 4, "bucket_size": 512})
    model.register_comm_hook(state, cgx_hook)

As CGX's: the hook averages each bucket (divides it by the group's size, then
all_reduces it with SUM on the state's group); in the third step (``step ==
2``: DDP has rebuilt its buckets in gradient order after the first, so their
layout is final) it registers every bucket's layers with
``torch_cgx.register_layer``: ``bits`` for a layer of more than one dimension
and at least ``layer_min_size`` elements, 32 (exact) for the others.
"""

# No `from __future__ import annotations`: DDP checks the hook's annotations at
# runtime (bucket: dist.GradBucket, return: Future[Tensor]).
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch_cgx

from mpx.launch.settings import SettingError
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.settings import CONFIG

__all__ = ["CGXState", "cgx_hook"]

VALUE_NO_COMPRESS = 32  # bits that mean "exact"
_DEFAULT_BUCKET_SIZE = 1024  # CGXState's default (the backend's own is 512)
_REGISTER_STEP = 2  # DDP's buckets are final from the second step on


def _env_int(key: str, default: int) -> int:
    setting = CONFIG[key]
    if not setting.is_set():
        return default
    try:
        return int(setting.read())
    except SettingError as error:
        raise QuantizeValueError(str(error)) from None


def _check_int(name: str, value: object, ok: bool, accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not ok:
        raise QuantizeValueError(f"CGXState: {name}={value!r} must be {accepted}")
    return value


class CGXState:
    """The state of :func:`cgx_hook`: the group, the layers' bits and bucket size.

    Args:
        process_group: the ``"cgx"`` group to all_reduce on (None: the default group).
        layer_min_size: layers with fewer elements go exact (at least
            ``CGX_COMPRESSION_MINIMAL_SIZE``, default 16).
        compression_params: ``{"bits": ..., "bucket_size": ...}``, each over
            ``CGX_COMPRESSION_QUANTIZATION_BITS`` (default 32: exact) and
            ``CGX_COMPRESSION_BUCKET_SIZE`` (default 1024), read when the state is made.

    Raises:
        QuantizeValueError: bits not 1-8 or 32, bucket size or layer_min_size
            not a positive integer, or a variable that does not parse.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None,
        layer_min_size: int = 1024,
        compression_params: Mapping[str, int] | None = None,
    ) -> None:
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        _check_int("layer_min_size", layer_min_size, layer_min_size >= 0, "an integer >= 0")
        self.layer_min_size = max(layer_min_size, _env_int("minimal_size", 16))
        bits = _env_int("bits", VALUE_NO_COMPRESS)
        bucket_size = _env_int("bucket_size", _DEFAULT_BUCKET_SIZE)
        if compression_params is not None:
            bits = compression_params.get("bits", bits)
            bucket_size = compression_params.get("bucket_size", bucket_size)
        ok_bits = isinstance(bits, int) and (1 <= bits <= 8 or bits == VALUE_NO_COMPRESS)
        self.quantization_bits = _check_int("bits", bits, ok_bits, "1 to 8, or 32 for exact")
        self.quantization_bucket_size = _check_int(
            "bucket_size", bucket_size, isinstance(bucket_size, int) and bucket_size > 0, "> 0"
        )
        self.step = 0

    def should_compress_(self, tensor: torch.Tensor) -> bool:
        """Whether a layer is quantized: more than one dimension, at least ``layer_min_size``."""
        return tensor.dim() > 1 and tensor.numel() >= self.layer_min_size


def _allreduce_mean(group: Any, tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    # Divided first, as CGX: a float16 sum of several ranks' gradients may overflow.
    tensor.div_(group.size())
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None  # async_op=True always gives a work
    future: torch.futures.Future[torch.Tensor] = work.get_future().then(lambda fut: fut.value()[0])
    return future


def cgx_hook(
    state: CGXState,
    bucket: dist.GradBucket,  # type: ignore[name-defined]  # (torch's stubs lack it)
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: registers the bucket's layers at step 2, averages the bucket on the group."""
    if state.step == _REGISTER_STEP:
        for layer_idx, grad in enumerate(bucket.gradients()):
            bits = state.quantization_bits if state.should_compress_(grad) else VALUE_NO_COMPRESS
            torch_cgx.register_layer(
                bucket.index(), layer_idx, grad.numel(), bits, state.quantization_bucket_size
            )
    if bucket.is_last():
        state.step += 1
    return _allreduce_mean(state.process_group, bucket.buffer())
