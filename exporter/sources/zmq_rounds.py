"""The KV subscriber's rounds over its SUB sockets: which have messages, then their messages.

One interface, two implementations: :class:`PyzmqRounds` here, through pyzmq's ``Poller`` and
``recv_multipart`` — the reference — and ``exporter.sources._zmq_rounds.Rounds``, the same through
libzmq's C API with readiness from an epoll set (its docstring says why). ``make_rounds()`` gives
the compiled one where it loads (``ROUNDS`` says which); a test holds both to the same messages,
frames and order.

The contract both keep, on the one thread that owns the sockets:

* ``follow(sockets)``: the sockets of the rounds from now on, in order; ``poll`` and ``drain``
  name them by index. Every one is drained in the next round. Called again (before the next poll)
  whenever a socket is added or closed.
* ``poll(timeout_ms)``: the indexes to drain this round — those with a message, and those whose
  last drain stopped at its limit — after waiting up to ``timeout_ms`` when there are none.
* ``drain(i, limit)``: up to ``limit`` messages of socket ``i``, each the list of its frames as
  ``bytes``, and True when the socket read empty (nothing of it waits).
* ``again(i)``: drain socket ``i`` in the next round whatever its readiness says — after anything
  else asked the socket for its events (``ZMQ_EVENTS`` reads its pending commands, and with them
  the signal the compiled rounds wait for).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import zmq


class SocketRounds(Protocol):
    def follow(self, sockets: Iterable[zmq.Socket]) -> None: ...
    def poll(self, timeout_ms: int) -> list[int]: ...
    def drain(self, i: int, limit: int) -> tuple[list[list[bytes]], bool]: ...
    def again(self, i: int) -> None: ...


class PyzmqRounds:
    """The reference: pyzmq's poller over every socket, ``recv_multipart`` until ``zmq.Again``."""

    def __init__(self) -> None:
        self._sockets: list[zmq.Socket] = []
        self._index: dict[zmq.Socket, int] = {}
        self._poller = zmq.Poller()
        self._pending: dict[int, None] = {}  # (ordered) drained next round whatever the poll says

    def follow(self, sockets: Iterable[zmq.Socket]) -> None:
        self._sockets = list(sockets)
        self._index = {s: i for i, s in enumerate(self._sockets)}
        self._poller = zmq.Poller()
        for s in self._sockets:
            self._poller.register(s, zmq.POLLIN)
        self._pending = dict.fromkeys(range(len(self._sockets)))

    def poll(self, timeout_ms: int) -> list[int]:
        if not self._sockets:
            return []
        ready = list(self._pending)
        self._pending = {}
        polled = self._poller.poll(0 if ready else timeout_ms)
        seen = set(ready)
        ready += [i for i in (self._index[s] for s, _ in polled) if i not in seen]
        return ready

    def drain(self, i: int, limit: int) -> tuple[list[list[bytes]], bool]:
        recv = self._sockets[i].recv_multipart
        messages: list[list[bytes]] = []
        for _ in range(limit):
            try:
                messages.append(recv(zmq.NOBLOCK))
            except zmq.Again:
                return messages, True
        self._pending[i] = None
        return messages, False

    def again(self, i: int) -> None:
        self._pending[i] = None


try:
    from exporter.sources._zmq_rounds import Rounds as _CompiledRounds
except ImportError:  # not built, or pyzmq's libzmq not found as one library: pyzmq's calls
    _CompiledRounds = None

ROUNDS = "compiled" if _CompiledRounds is not None else "reference"


def make_rounds(compiled: bool = True) -> SocketRounds:
    """The compiled rounds where they load (and ``compiled``), else the reference."""
    if compiled and _CompiledRounds is not None:
        return _CompiledRounds()
    return PyzmqRounds()
