"""The KV subscriber's socket rounds: the compiled rounds (libzmq's C API, epoll readiness) give
what the reference (pyzmq's poller and ``recv_multipart``) gives — the same messages, frames and
order per socket — over real PUB/SUB sockets on 127.0.0.1."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
import zmq

from exporter.sources import zmq_rounds
from exporter.sources.zmq_rounds import PyzmqRounds, SocketRounds
from tests.support import unavailable

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def ctx() -> Iterator[zmq.Context]:
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _compiled() -> SocketRounds:
    if zmq_rounds.ROUNDS != "compiled":  # (CI builds it: there, its absence fails)
        unavailable("the compiled rounds (exporter.sources._zmq_rounds) are not built or found no libzmq")
    return zmq_rounds.make_rounds()


def _pair(ctx: zmq.Context, n: int) -> tuple[list[zmq.Socket], list[zmq.Socket], list[zmq.Socket]]:
    """``n`` publishers, each followed by two SUB sockets (one per implementation)."""
    pubs, a, b = [], [], []
    for _ in range(n):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        pubs.append(pub)
        for subs in (a, b):
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{port}")
            subs.append(sub)
    _joined(pubs, a + b)
    return pubs, a, b


def _joined(pubs: list[zmq.Socket], subs: list[zmq.Socket]) -> None:
    """Wait until every subscription reached its publisher (a probe gets through), then empty them."""
    poller = zmq.Poller()
    for s in subs:
        poller.register(s, zmq.POLLIN)
    pending = set(subs)
    deadline = time.monotonic() + 30
    while pending and time.monotonic() < deadline:
        for p in pubs:
            p.send(b"probe")
        for s, _ in poller.poll(50):
            while True:
                try:
                    s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            pending.discard(s)
    assert not pending, "subscriptions did not propagate"
    time.sleep(0.2)
    for s in subs:
        while s.poll(20):
            s.recv_multipart()


def _messages(rng: random.Random, n: int) -> list[list[bytes]]:
    """Messages of the shapes a subscriber meets: vLLM's three frames, and malformed ones."""
    out = []
    for k in range(n):
        shape = rng.random()
        if shape < 0.7:
            out.append([b"kv", k.to_bytes(8, "big"), rng.randbytes(rng.choice((0, 1, 100, 5000)))])
        elif shape < 0.8:
            out.append([rng.randbytes(rng.randrange(0, 20))])
        elif shape < 0.9:
            out.append([b"", b"", b""])
        else:
            out.append([rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(2, 7))])
    return out


def _collect(rounds: SocketRounds, n: int, want: int, limit: int) -> tuple[dict[int, list[list[bytes]]], int]:
    got: dict[int, list[list[bytes]]] = {i: [] for i in range(n)}
    polls, deadline = 0, time.monotonic() + 60
    while sum(map(len, got.values())) < want and time.monotonic() < deadline:
        polls += 1
        for i in rounds.poll(100):
            messages, _ = rounds.drain(i, limit)
            got[i] += messages
    return got, polls


@pytest.mark.parametrize("limit", [1, 3, 256])
def test_compiled_rounds_give_what_pyzmq_gives(ctx: zmq.Context, limit: int) -> None:
    rng = random.Random(limit)
    n = 12
    pubs, a, b = _pair(ctx, n)
    compiled, reference = _compiled(), PyzmqRounds()
    compiled.follow(a)
    reference.follow(b)
    sent: dict[int, list[list[bytes]]] = {i: [] for i in range(n)}
    total = 0
    for burst in range(5):  # bursts over random publishers, rounds in between
        for m in _messages(rng, 200):
            i = rng.randrange(n)
            pubs[i].send_multipart(m)
            sent[i].append(m)
            total += 1
        time.sleep(0.05 * burst)
    got_c, _ = _collect(compiled, n, total, limit)
    got_r, _ = _collect(reference, n, total, limit)
    assert got_c == sent
    assert got_r == sent
    for rounds in (compiled, reference):  # all read: a drain now reads empty at once
        assert all(rounds.drain(i, limit) == ([], True) for i in range(n))


def test_a_drain_that_stops_at_its_limit_is_in_the_next_round(ctx: zmq.Context) -> None:
    pubs, a, b = _pair(ctx, 2)
    both = ((_compiled(), a), (PyzmqRounds(), b))
    for rounds, subs in both:
        rounds.follow(subs)
        assert all(rounds.drain(i, 10) == ([], True) for i in rounds.poll(0))  # (each drained once after follow)
    for k in range(5):
        pubs[1].send_multipart([b"", k.to_bytes(8, "big"), b"x"])
    for rounds, _ in both:
        deadline = time.monotonic() + 10
        ready: list[int] = []
        while not ready and time.monotonic() < deadline:
            ready = rounds.poll(100)
        assert ready == [1]
        messages, emptied = rounds.drain(1, 2)
        assert (len(messages), emptied) == (2, False)
        assert rounds.poll(10_000) == [1]  # no wait: it still holds messages
        messages, emptied = rounds.drain(1, 2)
        assert (len(messages), emptied) == (2, False)
        assert rounds.poll(0) == [1]
        assert [m[1] for m in rounds.drain(1, 2)[0]] == [(4).to_bytes(8, "big")]


def test_a_socket_whose_events_were_asked_is_drained_again_when_told(ctx: zmq.Context) -> None:
    """Asking a socket for ``ZMQ_EVENTS`` reads its commands, and with them the signal its
    descriptor gave: ``again`` puts it in the next round anyway."""
    pubs, a, b = _pair(ctx, 1)
    both = ((_compiled(), a), (PyzmqRounds(), b))
    for rounds, subs in both:
        rounds.follow(subs)
        for i in rounds.poll(0):
            rounds.drain(i, 10)
    pubs[0].send_multipart([b"", b"\0" * 8, b"late"])
    for rounds, subs in both:
        deadline = time.monotonic() + 10
        while not subs[0].getsockopt(zmq.EVENTS) & zmq.POLLIN:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        rounds.again(0)
        assert rounds.poll(10_000) == [0]
        assert rounds.drain(0, 10) == ([[b"", b"\0" * 8, b"late"]], True)


def test_following_again_after_a_socket_closed(ctx: zmq.Context) -> None:
    pubs, a, _ = _pair(ctx, 3)
    rounds = _compiled()
    rounds.follow(a)
    a[1].close(0)
    rounds.follow([a[0], a[2]])
    for i in rounds.poll(0):
        rounds.drain(i, 10)
    pubs[2].send_multipart([b"t", b"\0" * 8, b"p"])
    deadline = time.monotonic() + 10
    ready: list[int] = []
    while not ready and time.monotonic() < deadline:
        ready = rounds.poll(100)
    assert ready == [1]
    assert rounds.drain(1, 10) == ([[b"t", b"\0" * 8, b"p"]], True)
    with pytest.raises(IndexError):
        rounds.drain(2, 1)
    rounds.follow([])
    assert rounds.poll(0) == []
