"""CGX's per-layer table and its environment, as CGX reads them, for the ``"cgx"`` group.

Written from CGX's documented behaviour (IST-DASLab/torch_cgx; none of its code):

- ``torch_cgx.register_layer(bucket_idx, layer_idx, numel, bits, bucket_size)``
  says that DDP bucket ``bucket_idx`` holds, at position ``layer_idx``, a layer
  of ``numel`` elements sent at ``bits`` (32: exact) with ``bucket_size`` values
  per quantization bucket (``bits``/``bucket_size`` 0: the environment's). Values out of
  CGX's ranges are refused where they are given (bits 1-8 or 32; a bucket size that fits
  CGX's C ``int``; no negatives), not read later as "the environment's".
  Once a layer is registered, each all_reduce of 16 elements or more is the
  next registered bucket, in index order, round and round (DDP reduces its
  buckets in index order every step); its size must be its layers' sum.
- The ``CGX_*`` variables are read again at every all_reduce (CGX's scripts and
  its own test change them between calls). :class:`EnvConfig` keeps the last
  configuration and the variables' text it came from: a call that finds the
  same text reuses it (a few dict lookups), a change is parsed once.
"""

from __future__ import annotations

from dataclasses import dataclass

from mpx.quantize.codec import check_bucket_size
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.reduction import MIN_COMPRESSED, CompressionConfig
from mpx.quantize.settings import CONFIG

__all__ = ["EnvConfig", "LayerSpec", "LayerTable", "layer_table"]

# Every variable CompressionConfig.from_env reads (mpx's names and CGX's).
_SETTINGS = tuple(CONFIG.values())


class EnvConfig:
    """The ``"cgx"`` group's configuration, from the environment as it is now.

    As CGX: no bits variable set means 32 bits (no quantization).
    """

    def __init__(self) -> None:
        self._key: tuple[tuple[str, str] | None, ...] | None = None
        self._config: CompressionConfig | None = None

    def current(self) -> CompressionConfig:
        """The configuration the variables give now (parsed again only if one changed).

        Raises:
            QuantizeValueError: a variable does not parse or is out of range
                (the message names it and its value).
        """
        key = tuple(setting.raw() for setting in _SETTINGS)  # uncached: the text now
        if key != self._key or self._config is None:
            config = CompressionConfig.from_env()
            if not CONFIG["bits"].is_set():
                # CGX's default: CGX_COMPRESSION_QUANTIZATION_BITS=32, no quantization.
                config = config.with_(bits=32)
            self._config, self._key = config, key
        return self._config


@dataclass
class LayerSpec:
    """One registered layer: its size, and its bits and bucket size (0: the environment's)."""

    numel: int
    bits: int
    bucket_size: int

    def config(self, env: CompressionConfig) -> CompressionConfig:
        """The layer's configuration: its own bits and bucket size over ``env``'s."""
        bits = self.bits if self.bits > 0 else env.bits
        bucket_size = self.bucket_size if self.bucket_size > 0 else env.bucket_size
        if (bits, bucket_size) == (env.bits, env.bucket_size):
            return env
        return env.with_(bits=bits, bucket_size=bucket_size)


def _index(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise QuantizeValueError(f"torch_cgx: {name}={value!r} must be an integer >= 0")
    return value


#: the largest bucket size CGX's bindings take (a C ``int``)
MAX_CGX_BUCKET_SIZE = 2**31 - 1


def _bits(value: object) -> int:
    # 0 is "not set": the layer takes CGX_COMPRESSION_QUANTIZATION_BITS.
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not (0 <= value <= 8 or value == 32)
    ):
        raise QuantizeValueError(
            f"torch_cgx: bits={value!r} must be 1 to 8, 32 for no compression, or 0 for "
            "CGX_COMPRESSION_QUANTIZATION_BITS"
        )
    return value


def _bucket_size(value: object) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or not 0 <= value <= MAX_CGX_BUCKET_SIZE
    ):
        raise QuantizeValueError(
            f"torch_cgx: bucket_size={value!r} must be an integer from 1 to 2**31 - 1 (CGX's "
            "C int), or 0 for CGX_COMPRESSION_BUCKET_SIZE"
        )
    return value if value == 0 else check_bucket_size(value)


class LayerTable:
    """The layers ``register_layer`` gave, by DDP bucket, and which bucket comes next."""

    def __init__(self) -> None:
        self.buckets: dict[int, dict[int, LayerSpec]] = {}
        self._next = 0

    def register_layer(
        self, bucket_idx: int, layer_idx: int, numel: int, bits: int, bucket_size: int
    ) -> None:
        """Records (or replaces) layer ``layer_idx`` of bucket ``bucket_idx``."""
        b, i = _index("bucket_idx", bucket_idx), _index("layer_idx", layer_idx)
        if isinstance(numel, bool) or not isinstance(numel, int) or numel <= 0:
            raise QuantizeValueError(f"torch_cgx.register_layer: numel={numel!r} must be > 0")
        self.buckets.setdefault(b, {})[i] = LayerSpec(numel, _bits(bits), _bucket_size(bucket_size))

    def _layer(self, bucket_idx: int, layer_idx: int, what: str) -> LayerSpec:
        found = self.buckets.get(bucket_idx, {}).get(layer_idx)
        if found is None:
            raise QuantizeValueError(
                f"torch_cgx.{what}({bucket_idx}, {layer_idx}, ...): no such layer; "
                "call torch_cgx.register_layer for it first"
            )
        return found

    def set_bits(self, bucket_idx: int, layer_idx: int, bits: int) -> None:
        self._layer(bucket_idx, layer_idx, "set_quantization_bits").bits = _bits(bits)

    def set_bucket_size(self, bucket_idx: int, layer_idx: int, bucket_size: int) -> None:
        layer = self._layer(bucket_idx, layer_idx, "set_quantization_bucket_size")
        layer.bucket_size = _bucket_size(bucket_size)

    def active(self) -> bool:
        return bool(self.buckets)

    def next_bucket(self, numel: int) -> list[LayerSpec] | None:
        """The layers of the bucket this all_reduce of ``numel`` elements is, or None.

        None (the tensor is taken whole) below CGX's 16 elements, which do not
        count as a bucket. The buckets are taken in index order, round and round.

        Raises:
            QuantizeValueError: the tensor's size is not the next bucket's.
        """
        if numel < MIN_COMPRESSED or not self.buckets:
            return None
        order = sorted(self.buckets)
        if self._next >= len(order):
            self._next = 0
        index = order[self._next]
        self._next += 1
        layers = [spec for _, spec in sorted(self.buckets[index].items())]
        expected = sum(spec.numel for spec in layers)
        if expected != numel:
            raise QuantizeValueError(
                f"the cgx group: an all_reduce of {numel} elements came where bucket {index} "
                f"was due, whose {len(layers)} registered layers hold {expected} elements; "
                "register every DDP bucket's layers in order (cgx_utils.cgx_hook does), "
                "all_reduce other tensors of 16 elements or more on another group, or "
                "torch_cgx.clear_layers() to take tensors whole"
            )
        return layers

    def clear(self) -> None:
        self.buckets.clear()
        self._next = 0


layer_table = LayerTable()
