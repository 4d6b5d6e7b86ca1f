"""``DistributedDataContainer``: each rank's shard of a data set.

The data set's indices (shuffled with ``seed + epoch`` when asked, the same
permutation on every rank) are cut into ``size`` contiguous shards::

    N = 10, size = 3         order: 0 1 2 3 4 5 6 7 8 9
    uneven="pad"   (default) 0 1 2 3 | 4 5 6 7 | 8 9 0 1    4 each, 2 repeated
    uneven="drop"            0 1 2   | 3 4 5   | 6 7 8      3 each, 9 left out
    uneven="keep"            0 1 2 3 | 4 5 6   | 7 8 9      disjoint, union = all
    uneven="ceil"            0 1 2 3 | 4 5 6 7 | 8 9        disjoint, ceil(N / size) each
                                                            but the last (FluxMPI's split)

Every rank must run the same number of steps with a synchronous optimizer
(each step is a collective), so "pad" (as torch's DistributedSampler: the
first indices are repeated) and "drop" give every rank the same length.
"keep" is exact (shards disjoint, their union the data set) but lengths
differ by one: use it for evaluation, or when the step count is agreed on
otherwise. "ceil" is FluxMPI's ``DistributedDataContainer``: blocks of
``ceil(N / size)``, so the last rank's is shorter and trailing ranks may get
none (N = 5, size = 4: 2, 2, 1, 0); :mod:`mpx.dataparallel.fluxmpi` uses it.
When ``size`` divides ``N`` all four are the same.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from mpx.collectives import CommLike
from mpx.dataparallel.errors import DataParallelTypeError, DataParallelValueError
from mpx.dataparallel.runtime import default_comm

__all__ = ["DistributedDataContainer"]

_MODES = ("pad", "drop", "keep", "ceil")


class DistributedDataContainer(torch.utils.data.Dataset[Any]):
    """This rank's shard of ``dataset``; a map-style torch Dataset.

    Args:
        dataset: anything with ``len()`` and integer indexing (a torch
            Dataset, a tensor, a list, a tuple of tensors indexed together).
        shuffle: permute the indices each epoch (``set_epoch``).
        seed: the permutation's seed (the same on every rank).
        uneven: "pad", "drop", "keep" or "ceil" when the ranks do not divide the
            length (see the module's diagram).
        comm: the ranks sharing the data (world by default).

    Example::

        train = DistributedDataContainer(TensorDataset(x, y), shuffle=True)
        loader = DataLoader(train, batch_size=32)
        for epoch in range(10): train.set_epoch(epoch); ...
    """

    def __init__(
        self,
        dataset: Any,
        shuffle: bool = False,
        seed: int = 0,
        uneven: str = "pad",
        *,
        comm: CommLike | None = None,
    ) -> None:
        if not hasattr(dataset, "__len__") or not hasattr(dataset, "__getitem__"):
            raise DataParallelTypeError(
                "DistributedDataContainer needs a data set with len() and indexing, got "
                f"{type(dataset).__name__}"
            )
        if uneven not in _MODES:
            raise DataParallelValueError(
                f"uneven must be one of {', '.join(_MODES)}, got {uneven!r}"
            )
        if not isinstance(seed, int):
            raise DataParallelTypeError(f"seed must be an int, got {type(seed).__name__}")
        comm = default_comm(comm)
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.uneven = uneven
        self.rank, self.size = comm.rank, comm.size
        self.epoch = 0
        n = _length(dataset)
        if uneven == "drop" and n < self.size:
            raise DataParallelValueError(
                f"uneven='drop' with {n} samples and {self.size} ranks leaves every rank empty; "
                "use uneven='pad' or fewer ranks"
            )
        self._indices = self._shard()

    def set_epoch(self, epoch: int) -> None:
        """Selects the permutation of ``epoch`` (call it on every rank at each epoch)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise DataParallelValueError(f"epoch must be a non-negative int, got {epoch!r}")
        self.epoch = epoch
        self._indices = self._shard()

    @property
    def indices(self) -> list[int]:
        """The data set indices of this rank's shard, in order."""
        return list(self._indices)

    def _shard(self) -> list[int]:
        n = _length(self.dataset)
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        if self.uneven == "keep":
            # Shard r gets n // size items, plus one for the first n % size shards.
            base, extra = divmod(n, self.size)
            start = self.rank * base + min(self.rank, extra)
            return order[start : start + base + (1 if self.rank < extra else 0)]
        if self.uneven == "ceil":
            per = -(-n // self.size)
            return order[self.rank * per : (self.rank + 1) * per]
        if self.uneven == "drop":
            per = n // self.size
        else:
            per = -(-n // self.size)
            while n and len(order) < per * self.size:
                order += order[: per * self.size - len(order)]
        return order[self.rank * per : (self.rank + 1) * per]

    def __len__(self) -> int:
        return len(self._indices)

    def __getitem__(self, i: int) -> Any:
        if not -len(self._indices) <= i < len(self._indices):
            raise IndexError(f"index {i} out of range for a shard of {len(self._indices)}")
        index = self._indices[i]
        if isinstance(self.dataset, tuple):
            return tuple(part[index] for part in self.dataset)
        return self.dataset[index]

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return (
            f"DistributedDataContainer(rank={self.rank}/{self.size}, {len(self)} of "
            f"{_length(self.dataset)}, shuffle={self.shuffle}, uneven={self.uneven!r})"
        )


def _length(dataset: Any) -> int:
    """Samples in ``dataset``; a tuple is parts indexed together (x, y)."""
    if isinstance(dataset, tuple):
        if not dataset:
            raise DataParallelValueError("a tuple data set needs at least one part, got ()")
        lengths = {len(part) for part in dataset}
        if len(lengths) != 1:
            raise DataParallelValueError(
                f"the parts of a tuple data set must have one length, got {sorted(lengths)}"
            )
        return lengths.pop()
    return len(dataset)
