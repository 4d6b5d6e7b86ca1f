"""Pipelining a model written as ordinary modules: :class:`Keyed` steps over a dict.

A transformer is usually an embedding, a list of blocks and a head, and its
``forward`` threads several values through them (the residual stream, a
mask, position ids). A pipeline needs the same computation as a sequence of
layers, each taking the previous one's output. ``Keyed`` turns each module
into such a layer over a dict of named values: it calls the module on the
values it ``reads`` and stores the result under ``writes``::

    layers = nn.Sequential(
        Keyed(model.embed, "ids", "h", drop=["ids"]),
        *(Keyed(block, ["h", "mask"], "h") for block in model.blocks),
        Keyed(model.head, "h", "logits"),
    )
    pipe = Pipeline(layers, balance=[3, 3])
    pipe.step({"ids": ids, "mask": mask}, targets, lambda out, y: loss(out["logits"], y))

The dict crosses the stage borders as it is (tensors that need no gradient,
such as masks and ids, get none); ``drop`` removes values no later layer
reads, so they do not travel further. The model's own modules are reused,
not copied, so its ``state_dict`` and optimizer see the same parameters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = ["Keyed"]


class Keyed(nn.Module):
    """``state[writes] = module(*[state[k] for k in reads])``, as one pipeline layer.

    Args:
        module: the step (any ``nn.Module``).
        reads: the names of its arguments, in order.
        writes: the name of its result; a sequence of names unpacks a tuple result.
        drop: names removed from the dict after the step (values no later layer reads).

    Example::

        step = Keyed(block, ["h", "mask"], "h")
        step({"h": h, "mask": mask})  # {"h": block(h, mask), "mask": mask}
    """

    def __init__(
        self,
        module: nn.Module,
        reads: str | Sequence[str],
        writes: str | Sequence[str],
        *,
        drop: Sequence[str] = (),
    ) -> None:
        super().__init__()
        self.module = module
        self.reads = [reads] if isinstance(reads, str) else list(reads)
        self.writes: str | list[str] = writes if isinstance(writes, str) else list(writes)
        self.drop = set(drop)

    def forward(self, state: dict[str, Any]) -> dict[str, Any]:
        if not isinstance(state, dict):
            raise PipelineTypeError(
                f"Keyed({type(self.module).__name__}) got a {type(state).__name__}; Keyed "
                "layers pass a dict of named values: give the pipeline a dict as inputs"
            )
        missing = [k for k in self.reads if k not in state]
        if missing:
            raise PipelineValueError(
                f"Keyed({type(self.module).__name__}) reads {missing}, not among "
                f"{sorted(state)}; write them in an earlier step or pass them as inputs"
            )
        result = self.module(*[state[k] for k in self.reads])
        new = {k: v for k, v in state.items() if k not in self.drop}
        if isinstance(self.writes, str):
            new[self.writes] = result
        else:
            if not isinstance(result, tuple) or len(result) != len(self.writes):
                raise PipelineValueError(
                    f"Keyed({type(self.module).__name__}) writes {self.writes} but the module "
                    f"returned {type(result).__name__}; return a tuple of {len(self.writes)}"
                )
            new.update(zip(self.writes, result, strict=True))
        return new

    def extra_repr(self) -> str:
        return f"reads={self.reads}, writes={self.writes!r}, drop={sorted(self.drop)}"
