"""A group behind the step catching up: its donor's state, and the loop's state after.

:class:`~mpx.dataparallel.recovery.optimizer.FaultTolerantOptimizer` decides who
sends what to whom and when (the lighthouse's quorum names a donor for each
group behind the step); :class:`StateTransfer` moves the bytes and loads them:

- a donor sends its state of the step's start (model, optimizer, step count,
  the loop's dict) in one ``STATE`` frame, from a thread, while its forward and
  backward run (:meth:`StateTransfer.start_sending`); the receiver loads it
  (:meth:`StateTransfer.receive`, :meth:`StateTransfer.load`);
- a group that joined a step (received it rather than trained it, see
  :mod:`mpx.launch.recovery.membership`) applied that step itself, but the loop
  changed its own state after the step returned (its data position, a
  scheduler's learning rate): the donor sends those in a ``LOOP`` frame at the
  next step's start (:meth:`StateTransfer.send_loop`,
  :meth:`StateTransfer.receive_loop`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, MutableMapping
from typing import Any

import torch
from torch import nn

from mpx.dataparallel.recovery.links import LOOP, STATE, PeerLost, recv_frame, send_frame
from mpx.dataparallel.recovery.state_payload import pack_state, unpack_state

__all__ = ["StateTransfer"]

# A loop's dict and an optimizer's settings are small: a LOOP frame far beyond this is none.
_LOOP_LIMIT = 64 << 20


class StateTransfer:
    """The state of ``model``, ``optimizer`` and the loop's dict ``state``, sent and received.

    ``nbytes``: the model's gradients' size, which bounds a state frame (the
    model, the optimizer's state: a few copies of it at most, and the loop's dict).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        state: MutableMapping[str, Any],
        nbytes: int,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.state = state
        self._limit = 16 * nbytes + (64 << 20)
        params = list(model.parameters())
        self._device = params[0].device if params else torch.device("cpu")
        self._sending: threading.Thread | None = None
        self._failed: PeerLost | None = None

    def start_sending(
        self,
        step: int,
        recipients: list[int],
        joining: set[int],
        quorum: int,
        link: Callable[[int], Any],
        check: Callable[[], None],
    ) -> None:
        """Sends the state of step ``step`` to ``recipients`` (``link(g)``: the link to
        ``g``) in a thread, beside the step's forward and backward; a recipient in
        ``joining`` that is gone is left out, any other fails the sending
        (:meth:`await_sending` raises).

        Before the thread, the donor's 10 MB send held its step ~10 ms (the bench's
        model, session 25's profile); the recipient waits for the bytes either way.
        The parameters and the optimizer's state stay as they are until the step's
        end (:meth:`await_sending` comes first): they go out as views. The model's
        buffers (a batch norm's running statistics) change in the forward: they go
        out as copies taken now.
        """
        with contextlib.suppress(PeerLost):
            self.await_sending()  # a last quorum's, if it failed before its step
        parameters = {p.data_ptr() for p in self.model.parameters()}
        model = {
            name: value if value.data_ptr() in parameters else value.clone()
            for name, value in self.model.state_dict().items()
        }
        parts = pack_state(
            {
                "model": model,
                "optimizer": self.optimizer.state_dict(),
                "step": step,
                "state": dict(self.state),
            }
        )
        self._failed = None

        def send() -> None:
            for recipient in recipients:
                try:
                    send_frame(link(recipient), quorum, STATE, parts, check)
                except PeerLost as lost:
                    if recipient not in joining:  # a member without the state: no step
                        self._failed = lost
                        return

        self._sending = threading.Thread(target=send, name="mpx-ft-state", daemon=True)
        self._sending.start()

    def await_sending(self) -> None:
        """Waits for :meth:`start_sending`'s thread; raises its PeerLost, if any."""
        if self._sending is None:
            return
        self._sending.join()
        self._sending = None
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def receive(self, sock: Any, quorum: int, check: Callable[[], None]) -> dict[str, Any]:
        """A donor's state (:meth:`start_sending`'s), not loaded yet."""
        kind, payload = recv_frame(sock, quorum, check, limit=self._limit)
        if kind != STATE:
            raise PeerLost("the donor sent no state")
        loaded: dict[str, Any] = unpack_state(payload, self._device)
        return loaded

    def load(self, loaded: dict[str, Any]) -> int:
        """Loads :meth:`receive`'s state; returns its step."""
        self.model.load_state_dict(loaded["model"])
        self.optimizer.load_state_dict(loaded["optimizer"])
        self.state.clear()
        self.state.update(loaded["state"])
        return int(loaded["step"])

    def send_loop(self, socks: list[Any], quorum: int, check: Callable[[], None]) -> None:
        """The loop's dict and the optimizer's settings (its param_groups less their
        parameters) to each of ``socks``; one gone is left out (it loads a whole
        state later)."""
        settings = [
            {k: v for k, v in group.items() if k != "params"}
            for group in self.optimizer.param_groups
        ]
        parts = pack_state({"state": dict(self.state), "settings": settings})
        for sock in socks:
            with contextlib.suppress(PeerLost):
                send_frame(sock, quorum, LOOP, parts, check)

    def receive_loop(self, sock: Any, quorum: int, check: Callable[[], None]) -> None:
        """:meth:`send_loop`'s frame, loaded."""
        kind, payload = recv_frame(sock, quorum, check, limit=_LOOP_LIMIT)
        if kind != LOOP:
            raise PeerLost("the donor sent no loop state")
        loop = unpack_state(payload, torch.device("cpu"))
        groups = self.optimizer.param_groups
        if not isinstance(loop, dict) or len(loop.get("settings", ())) != len(groups):
            raise PeerLost("the donor's loop state is not this optimizer's")
        self.state.clear()
        self.state.update(loop["state"])
        for group, settings in zip(groups, loop["settings"], strict=True):
            group.update({k: v for k, v in settings.items() if k != "params"})
