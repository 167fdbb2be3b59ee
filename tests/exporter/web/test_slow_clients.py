"""Scrapes that slow clients cannot starve (a running exporter on 127.0.0.1).

Before, every connection held a thread and one of ``web.max_connections`` slots while it sent
its request: 64 idle connections from one client made scrapes answer 503, 200 held /metrics for
up to 10 s and left some unanswered, and 100 slow bodies cost hundreds of megabytes. Here 200
idle, 200 trickling and 100 half-body clients — all from the scraper's own address — are kept
connected (reconnecting when the exporter closes them) while /metrics and /healthz are scraped.
"""

from __future__ import annotations

import contextlib
import resource
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from exporter.config import load_config
from exporter.main import Runtime


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[Runtime]:
    cfg_file = tmp_path / "exporter.yaml"
    cfg_file.write_text("web: {read_timeout: 10s}\n")
    rt = Runtime.build(load_config(cfg_file).with_overrides(listen_address="127.0.0.1:0")).start()
    yield rt
    rt.stop()


class Crowd:
    """``n`` connections kept open by one thread, each fed by ``feed`` every round; a connection
    the exporter closes is opened again."""

    def __init__(self, address: tuple[str, int], n: int, opening: bytes, feed: Callable[[socket.socket], None]) -> None:
        self.address, self.n, self.opening, self.feed = address, n, opening, feed
        self.socks: list[socket.socket] = []
        self.stop = threading.Event()
        self.opened = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _open(self) -> socket.socket | None:
        try:
            s = socket.create_connection(self.address, timeout=2)
        except OSError:
            return None
        s.setblocking(False)
        with contextlib.suppress(OSError):
            s.send(self.opening)
        self.opened += 1
        return s

    def _alive(self, s: socket.socket) -> bool:
        try:
            return s.recv(65536) != b""  # an answer (503, 408) or nothing yet
        except BlockingIOError:
            return True
        except OSError:
            return False

    def _run(self) -> None:
        while not self.stop.is_set():
            keep = []
            for s in self.socks:
                if self._alive(s):
                    with contextlib.suppress(OSError):
                        self.feed(s)
                    keep.append(s)
                else:
                    s.close()
            while len(keep) < self.n and not self.stop.is_set():
                s = self._open()
                if s is None:
                    break
                keep.append(s)
            self.socks = keep
            self.stop.wait(0.1)
        for s in self.socks:
            s.close()

    def __enter__(self) -> Crowd:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(10)


def _nothing(_s: socket.socket) -> None:
    pass


def _trickle(s: socket.socket) -> None:
    s.send(b"X")  # one more byte of a header line that never ends


HALF_BODY = b"x" * 500_000


def test_idle_trickling_and_half_body_clients_leave_every_scrape_answered(exporter: Runtime) -> None:
    address = exporter.server.address
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    head = b"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nContent-Length: 1000000\r\n\r\n"
    with Crowd(address, 200, b"", _nothing) as idle, \
            Crowd(address, 200, b"GET /metrics HTTP/1.1\r\nX-Slow: ", _trickle) as trickling, \
            Crowd(address, 100, head + HALF_BODY, _nothing) as half_body:
        time.sleep(2)  # every crowd connected
        answered = []
        for i in range(12):
            path = "/metrics" if i % 2 == 0 else "/healthz"
            r = requests.get(exporter.url + path, timeout=5)  # a scrape that waits more than 5 s fails
            answered.append(r.status_code)
            time.sleep(0.5)
        assert idle.opened >= 200 and trickling.opened >= 200 and half_body.opened >= 100
    assert answered == [200] * 12
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert grown_mb < 200, grown_mb  # bodies are held to their budget, heads to 64 KB, no thread per client
    assert requests.post(exporter.url + "/api/v1/records", data=b"", timeout=5).status_code == 200
