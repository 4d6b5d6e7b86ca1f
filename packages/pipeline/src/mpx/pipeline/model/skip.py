"""Skip connections across stages, in torchgpipe's style: ``skippable``, ``stash``, ``pop``.

A layer declares the names it stashes and pops; its ``forward`` yields
``stash(name, tensor)`` to leave a tensor for a later layer and
``pop(name)`` to take one (the ``yield`` returns it)::

    @skippable(stash=["x0"])
    class Embed(nn.Module):
        def forward(self, ids):
            x = self.tok(ids)
            yield stash("x0", x)
            return x

    @skippable(pop=["x0"])
    class Head(nn.Module):
        def forward(self, h):
            x0 = yield pop("x0")
            return self.out(h + x0)

How the tensor gets there. Within a stage, through a dict of the stage's
micro-batch (a *tracker*). Across a border, the pipeline sends every name
stashed and not yet popped with the activation: a border is ``(output,
{name: tensor})``, so a skip from stage ``i`` to stage ``j`` rides through the
stages between, which pass it on untouched (and its gradient back). torchgpipe
copies a skip straight from partition ``i`` to ``j`` (its "portals"); here
that would be a new link per skip, with its own receives to post early, its
own tags and its own settling after a failure. Riding on the neighbour links
costs each stage in between one send and one receive of the tensor each way
and needs nothing new: recomputation, every schedule and the failure
settling see one structure per border, as they would for a dict the user
passed along (which works too: a skip is a dict entry that every layer in
between keeps).

Outside a pipeline (the whole model in one process) the layers share one
module-level tracker, so the same model runs unchanged; it is not thread-safe.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from mpx.pipeline.errors import PipelineTypeError, PipelineValueError

__all__ = [
    "Pop",
    "Stash",
    "check_skips",
    "pop",
    "skippable",
    "stash",
    "tracking",
    "uses_skips",
]

M = TypeVar("M", bound=type[nn.Module])


@dataclass(frozen=True)
class Stash:
    """What ``yield stash(name, tensor)`` hands the tracker."""

    name: str
    tensor: torch.Tensor


@dataclass(frozen=True)
class Pop:
    """What ``yield pop(name)`` asks the tracker for."""

    name: str


def stash(name: str, tensor: torch.Tensor) -> Stash:
    """Leaves ``tensor`` under ``name`` for a later layer (``yield stash(...)``)."""
    return Stash(name, tensor)


def pop(name: str) -> Pop:
    """Takes the tensor stashed under ``name`` (``x = yield pop(...)``)."""
    return Pop(name)


_DEFAULT: dict[str, torch.Tensor] = {}
_TRACKERS: list[dict[str, torch.Tensor]] = []


@contextlib.contextmanager
def tracking(skips: dict[str, torch.Tensor]) -> Iterator[dict[str, torch.Tensor]]:
    """Skippable layers run inside stash into and pop from ``skips`` (one micro-batch's).

    Example::

        skips = {}
        with tracking(skips):
            h = embed(ids)          # stashes "x0" into skips
        send((h, skips))            # what a stage border carries
    """
    _TRACKERS.append(skips)
    try:
        yield skips
    finally:
        _TRACKERS.pop()


def _drive(module: nn.Module, steps: Any) -> Any:
    """Runs a skippable forward's generator, answering its stashes and pops."""
    tracker = _TRACKERS[-1] if _TRACKERS else _DEFAULT
    kind = type(module).__name__
    stashes: tuple[str, ...] = getattr(type(module), "stashes", ())
    pops: tuple[str, ...] = getattr(type(module), "pops", ())
    value = None
    while True:
        try:
            op = steps.send(value)
        except StopIteration as done:
            return done.value
        value = None
        if isinstance(op, Stash):
            if op.name not in stashes:
                raise PipelineValueError(
                    f"{kind} stashes {op.name!r} but declares stash={list(stashes)}; "
                    "add it to @skippable(stash=[...])"
                )
            tracker[op.name] = op.tensor
        elif isinstance(op, Pop):
            if op.name not in pops:
                raise PipelineValueError(
                    f"{kind} pops {op.name!r} but declares pop={list(pops)}; "
                    "add it to @skippable(pop=[...])"
                )
            if op.name not in tracker:
                raise PipelineValueError(
                    f"{kind} pops {op.name!r}, which no earlier layer stashed for this input"
                )
            value = tracker.pop(op.name)
        else:
            raise PipelineTypeError(
                f"{kind}.forward yielded a {type(op).__name__}; a skippable layer yields "
                "stash(name, tensor) or pop(name)"
            )


def skippable(*, stash: Sequence[str] = (), pop: Sequence[str] = ()) -> Callable[[M], M]:
    """Declares the skip names a layer class stashes and pops (a class decorator).

    Its ``forward`` may then ``yield stash(name, t)`` and ``x = yield pop(name)``;
    the layer is called as usual and returns what ``forward`` returns.
    """

    def wrap(cls: M) -> M:
        forward = cls.forward

        def skipping_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            result = forward(self, *args, **kwargs)
            return _drive(self, result) if inspect.isgenerator(result) else result

        # setattr: the declarations are new class attributes, read back with getattr.
        setattr(cls, "forward", skipping_forward)  # noqa: B010
        setattr(cls, "stashes", tuple(stash))  # noqa: B010
        setattr(cls, "pops", tuple(pop))  # noqa: B010
        return cls

    return wrap


def _declared(layer: nn.Module, attribute: str) -> set[str]:
    return {name for m in layer.modules() for name in getattr(type(m), attribute, ())}


def uses_skips(module: nn.Module) -> bool:
    """Whether any layer of ``module`` is skippable."""
    return any(hasattr(type(m), "stashes") for m in module.modules())


def check_skips(layers: Sequence[nn.Module]) -> None:
    """Every popped name stashed by an earlier layer, every stashed one popped later.

    Raises:
        PipelineValueError: naming the layer and the skip.
    """
    open_since: dict[str, int] = {}
    for index, layer in enumerate(layers):
        stashes, pops = _declared(layer, "stashes"), _declared(layer, "pops")
        for name in sorted(pops):
            if name in open_since:
                del open_since[name]
            elif name in stashes:
                stashes.discard(name)  # stashed and popped inside this layer
            else:
                raise PipelineValueError(
                    f"layer {index} pops skip {name!r}, which no earlier layer stashes; "
                    "stash it before (or remove the pop)"
                )
        for name in sorted(stashes):
            if name in open_since:
                raise PipelineValueError(
                    f"layer {index} stashes skip {name!r} again before layer "
                    f"{open_since[name]}'s is popped; use another name"
                )
            open_since[name] = index
    if open_since:
        name, index = next(iter(open_since.items()))
        raise PipelineValueError(
            f"layer {index} stashes skip {name!r}, which no later layer pops; pop it "
            "(a pipeline would carry it to the end)"
        )
