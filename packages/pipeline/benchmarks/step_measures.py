"""What the pipeline benchmarks measure beside a step's time (``bench_transformer.py`` and
``bench_conv1d.py`` import it from this folder): the bytes saved for backward alive at
once, and a step's bound at its own pass costs."""

from __future__ import annotations

import statistics
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["SavedBytes", "pass_cost_bound"]


class SavedBytes:
    """Bytes saved for backward alive at once (by storage; parameters left out)."""

    def __init__(self, params: set[int], deferred: Callable[[], int] = lambda: 0) -> None:
        self.params = params
        # Bytes the split backward keeps for W outside the graph (mpx's
        # Pipeline.deferred_bytes): counted beside the saved tensors.
        self.deferred = deferred
        self.live: dict[int, list[int]] = {}  # storage -> [bytes, saved copies]
        self.now = self.peak = 0

    def pack(self, t: Any) -> Any:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params:
            return t
        holder = _Holder(t)
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1]
            self.now += storage.nbytes()
            self.peak = max(self.peak, self.now + self.deferred())
        weakref.finalize(holder, self._drop, key)
        return holder

    def _drop(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    @staticmethod
    def unpack(holder: Any) -> Any:
        return holder.t if isinstance(holder, _Holder) else holder


class _Holder:
    __slots__ = ("__weakref__", "t")

    def __init__(self, t: Any) -> None:
        self.t = t


def pass_cost_bound(traces: list[list[tuple[str, int, int, float, float]]]) -> float:
    """The step's lists (every rank's compute actions, in the order they ran) timed
    against the dependencies at the step's own pass costs (per kind and virtual
    stage, the median over its micro-batches), sends and receives free: the
    shortest step this layout allows at these costs. The executor's
    overhead and the messages' latency are what the step takes beyond it; one
    schedule's bound over another's is the most its layout can gain at these costs
    (a zero-bubble layout pays its split backward's costs here too)."""
    from mpx.pipeline.schedules.actions import COMPUTE, Action
    from mpx.pipeline.schedules.timing import timeline

    lists = [[Action(k, mb, s) for k, mb, s, _, _ in row if k in COMPUTE] for row in traces]
    stages = 1 + max(a.stage for row in lists for a in row)
    durations: dict[tuple[str, int], list[float]] = {}
    for row in traces:
        for k, _, s, start, end in row:
            if k in COMPUTE:
                durations.setdefault((k, s), []).append(end - start)
    costs = {
        k: [statistics.median(durations.get((k, s), [0.0])) for s in range(stages)] for k in COMPUTE
    }
    return max(end for row in timeline(lists, costs) for _, end, _ in row)
