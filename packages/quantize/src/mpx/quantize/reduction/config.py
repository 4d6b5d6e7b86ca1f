"""``CompressionConfig`` (and its environment variables) and layer filtering.

Which tensors are compressed::

    compressed   <=>  config.enabled (bits 1-8)
                      and numel >= max(minimal_size, 16)
                      and, where a name and shape are known (allreduce_tensors, the DDP hook):
                          more than one dimension and no exclude pattern in the name

The environment variables (``MPX_QUANTIZE_*``, with CGX's names as aliases;
the MPX name wins when both are set) are declared in
:mod:`mpx.quantize.settings`; ``mpxrun --settings`` lists them.

``bits=32`` (CGX's default) turns compression off.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from mpx.launch.settings import SettingError
from mpx.quantize.codec import check_bucket_size
from mpx.quantize.errors import QuantizeValueError
from mpx.quantize.settings import CONFIG

__all__ = [
    "CompressionConfig",
    "LayerRegistry",
    "exclude_layer",
    "register_model",
    "registry",
]

# What CompressionConfig.communicator accepts (CGX's CGX_INNER_COMMUNICATOR_TYPE, any case):
# CGX's MPI and SHM communicators are the mpx.collectives implementations of the
# same names (the MPI library's collectives; the node's shared memory), looked up
# in mpx.collectives' registry; auto lets the collectives' policy choose.
COMMUNICATORS = ("auto", "mpi", "shm")

# CompressionConfig.when: compress every compressible tensor, or where measured faster.
WHEN = ("always", "auto")

# CGX compresses nothing below 16 elements, whatever minimal_size says.
MIN_COMPRESSED = 16


@dataclass(frozen=True)
class CompressionConfig:
    """How the compressed allreduce quantizes.

    Args:
        bits: bits per value, 1-8; 32 turns compression off (CGX's convention).
        bucket_size: values per bucket (each has its own min and unit).
        skip_incomplete_buckets: send a short last bucket raw.
        minimal_size: tensors with fewer elements go uncompressed (never below 16).
        fusion_buffer_mb: small tensors are fused into buffers of this size.
        error_feedback: keep each rank's quantization error and add it to the
            next step's tensor (not in CGX).
        exclude: name parts of layers that stay in full precision ("bn", "bias").
        stochastic: unbiased stochastic rounding (else nearest).
        seed: seed of the stochastic rounding (offset by the rank).
        communicator: the collectives implementation under the compressed
            allreduce (CGX's CGX_INNER_COMMUNICATOR_TYPE): auto, mpi or shm.
        when: ``"always"`` compresses every compressible tensor; ``"auto"``
            first times, once per buffer size, the compressed and the plain
            allreduce on this job's link and compresses only where that is
            clearly faster (:mod:`mpx.quantize.compression_choice`): not over
            shared memory on one node, yes across nodes on a slow network.

    Example::

        config = CompressionConfig(bits=4, bucket_size=1024, exclude=("bn",))
        mpx.quantize.allreduce(flat_grads, config=config, op="avg")
        config = CompressionConfig.from_env()        # MPX_QUANTIZE_* / CGX_*
    """

    bits: int = 4
    bucket_size: int = 512
    skip_incomplete_buckets: bool = False
    minimal_size: int = MIN_COMPRESSED
    fusion_buffer_mb: float = 64.0
    error_feedback: bool = False
    exclude: tuple[str, ...] = field(default_factory=tuple)
    stochastic: bool = True
    seed: int = 0
    communicator: str = "auto"
    when: str = "always"

    def __post_init__(self) -> None:
        bits = self.bits
        if (
            isinstance(bits, bool)
            or not isinstance(bits, int)
            or not (1 <= bits <= 8 or bits == 32)
        ):
            raise QuantizeValueError(
                f"CompressionConfig bits={bits!r} must be 1 to 8, or 32 for no compression"
            )
        check_bucket_size(self.bucket_size)
        if isinstance(self.minimal_size, bool) or not isinstance(self.minimal_size, int):
            raise QuantizeValueError(f"minimal_size={self.minimal_size!r} must be an integer")
        if self.minimal_size < 0:
            raise QuantizeValueError(f"minimal_size={self.minimal_size} must be >= 0")
        if not self.fusion_buffer_mb > 0:
            raise QuantizeValueError(f"fusion_buffer_mb={self.fusion_buffer_mb!r} must be > 0")
        exclude: object = self.exclude
        if isinstance(exclude, str):
            # exclude="bn" would otherwise exclude every name containing "b" or "n"
            object.__setattr__(self, "exclude", (self.exclude,))
        else:
            object.__setattr__(self, "exclude", tuple(self.exclude))
        for part in self.exclude:
            if not isinstance(part, str) or not part:
                raise QuantizeValueError(f"exclude entries must be non-empty strings, got {part!r}")
        if not isinstance(self.communicator, str) or self.communicator.lower() not in COMMUNICATORS:
            raise QuantizeValueError(
                f"communicator={self.communicator!r} is not one of {list(COMMUNICATORS)} "
                "(CGX's CGX_INNER_COMMUNICATOR_TYPE: MPI or SHM; its NCCL has no CPU "
                "transport here; auto lets mpx.collectives choose)"
            )
        object.__setattr__(self, "communicator", self.communicator.lower())
        if self.when not in WHEN:
            raise QuantizeValueError(
                f"when={self.when!r} must be one of {list(WHEN)}: 'always' compresses every "
                "compressible tensor, 'auto' only where it is measured to be faster"
            )

    def impl(self, op: str) -> str:
        """The mpx.collectives implementation of ``op`` under ``communicator``.

        The registry's implementation of that name runs the op where it
        provides it (``Implementation.provides``: SHM's ``shm`` runs
        allreduce, broadcast and allgather); any other op (the alltoall under
        SHM) takes ``auto``'s choice. Always a name, never None (which would
        be ``MPX_COLLECTIVES_IMPL``'s choice): under ``MPX_COLLECTIVES_IMPL=cgx``
        that is the compressed allreduce itself, and a tensor it leaves
        uncompressed went back into it without end. ``"auto"`` never picks
        ``cgx``.

        Raises:
            QuantizeValueError: mpx.collectives registers no implementation of
                that name (the message lists those it has).
        """
        if self.communicator == "auto":
            return "auto"
        # Here, not at the top: torch_cgx imports this module, and must not import MPI.
        from mpx.collectives import all_implementations

        implementations = all_implementations()
        found = implementations.get(self.communicator)
        if found is None:
            raise QuantizeValueError(
                f"communicator={self.communicator!r}: mpx.collectives has no implementation of "
                f"that name (it has {', '.join(implementations)}); use communicator='auto'"
            )
        return found.name if op in found.provides else "auto"

    @property
    def enabled(self) -> bool:
        """False for ``bits=32``: everything goes uncompressed."""
        return self.bits <= 8

    @property
    def min_compressed(self) -> int:
        """The smallest tensor that is compressed: ``max(minimal_size, 16)``."""
        return max(self.minimal_size, MIN_COMPRESSED)

    @property
    def fusion_buffer_bytes(self) -> int:
        return int(self.fusion_buffer_mb * 2**20)

    def compresses(self, numel: int, name: str | None = None, dim: int | None = None) -> bool:
        """Whether a tensor of ``numel`` elements, ``name``, ``dim`` dimensions is compressed.

        ``name`` and ``dim`` are what layer filtering knows; a bare flat buffer
        (``allreduce(t)``) is judged by its size alone.
        """
        if not self.enabled or numel < self.min_compressed:
            return False
        if dim is not None and dim <= 1:
            return False
        return not (
            name is not None and any(part in name for part in (*self.exclude, *registry.excluded))
        )

    def with_(self, **changes: object) -> CompressionConfig:
        """A copy with some fields changed."""
        return replace(self, **changes)  # type: ignore[arg-type]

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, **overrides: object
    ) -> CompressionConfig:
        """A config from ``MPX_QUANTIZE_*`` (or CGX's names); ``overrides`` win over both.

        Configured through CGX's variables (any ``CGX_*`` or ``COMMUNICATOR_TYPE``
        set, no bits variable), the bits are CGX's default, 32: no compression.

        Raises:
            QuantizeValueError: a variable does not parse; the message names it.
        """
        values: dict[str, object] = {}
        read: list[str] = []  # "NAME=raw" of each variable read, for the error message
        cgx = False
        for key, setting in CONFIG.items():
            found = setting.raw(environ)
            if found is None:
                continue  # unset: the dataclass's default
            read.append(f"{found[0]}={found[1]!r}")
            cgx = cgx or not found[0].startswith("MPX_")
            try:
                value = setting.parse(found[1], found[0])
            except SettingError as error:
                raise QuantizeValueError(str(error)) from None
            if key == "exclude":
                value = tuple(p.strip() for p in value.split(",") if p.strip())
            if key == "bits":
                value = int(value)  # declared as a choice of texts (mpx.quantize.settings)
            values[key] = value
        if cgx and "bits" not in values:
            # Configured the CGX way: CGX's default, 32 bits, compresses nothing.
            values["bits"] = 32
        values.update(overrides)
        try:
            return cls(**values)  # type: ignore[arg-type]
        except QuantizeValueError as error:
            origin = ", ".join(read) if read else "no variable set"
            raise QuantizeValueError(f"{error} (from the environment: {origin})") from None


class LayerRegistry:
    """Parameter names and excluded name parts, as CGX's ``register_model``.

    Example::

        mpx.quantize.register_model(model)
        mpx.quantize.exclude_layer("bn")      # batch norm stays in full precision
        mpx.quantize.exclude_layer("bias")
    """

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.order: list[tuple[str, int]] = []
        self.excluded: list[str] = []

    def register_model(
        self, model: torch.nn.Module | Iterable[tuple[str, torch.Tensor | int]]
    ) -> None:
        """Records parameter names: a module, or (name, parameter or numel) pairs."""
        pairs = model.named_parameters() if isinstance(model, torch.nn.Module) else model
        for name, item in pairs:
            if isinstance(item, torch.Tensor):
                self.names[id(item)] = name
                self.order.append((name, item.numel()))
            else:
                self.order.append((name, int(item)))

    def exclude_layer(self, part: str) -> None:
        """Layers whose name contains ``part`` are allreduced in full precision."""
        if not isinstance(part, str) or not part:
            raise QuantizeValueError(f"exclude_layer needs a non-empty name part, got {part!r}")
        if part not in self.excluded:
            self.excluded.append(part)

    def name_of(self, param: torch.Tensor) -> str | None:
        return self.names.get(id(param))

    def names_for(self, numels: list[int]) -> list[str] | None:
        """Names of a run of parameters known only by their sizes, or None.

        CGX's ``register_model([(name, numel), ...])`` gives the layers in
        order, without the tensors; a DDP bucket holds a contiguous run of
        them, in registration order or reversed (DDP's). The run is named
        when exactly one place in the registered order has those sizes.
        """
        sizes = [n for _, n in self.order]
        found: list[list[str]] = []
        k = len(numels)
        for start in range(len(sizes) - k + 1):
            window = sizes[start : start + k]
            names = [name for name, _ in self.order[start : start + k]]
            if window == numels:
                found.append(names)
            if k > 1 and window[::-1] == numels:
                found.append(names[::-1])
        return found[0] if len(found) == 1 else None

    def clear(self) -> None:
        self.names.clear()
        self.order.clear()
        self.excluded.clear()


registry = LayerRegistry()


def register_model(model: torch.nn.Module | Iterable[tuple[str, torch.Tensor | int]]) -> None:
    """Registers a model's parameter names for layer filtering (see :class:`LayerRegistry`)."""
    registry.register_model(model)


def exclude_layer(part: str) -> None:
    """Keeps layers whose name contains ``part`` uncompressed (e.g. ``"bn"``, ``"bias"``)."""
    registry.exclude_layer(part)
