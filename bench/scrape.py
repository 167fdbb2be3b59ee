"""Scraping a thousand workers: the exporter's CPU per round, and per-scrape state work against W.

The workers' vLLM /metrics pages (``bench.parse.worker_page``: ~300 lines rendered by
prometheus_client, histograms included) are served by one asyncio process on a few ports of
127.0.0.1 (``/w/<name>/metrics``, HTTP/1.1 keep-alive, gzip when the client accepts it), so the
exporter's process holds only the exporter: the real ``Scraper`` over ``W`` targets feeding a
real ``ClusterState``. A round is one ``scrape_once()``; its CPU time (this process) as a share
of a core at the default 5 s interval is the first row (target ≤ 20 %), measured after a first
round that opens the connections, as a scraper does once. The baseline is the bare parse of the
same pages (``promtext.parse`` of the names the normaliser reads), the least a round must do.

The second row is the state's work per scrape (``ClusterState.observe_worker``) at W = 1,000
against W = 100, over rounds whose scrape times advance 5 s each (a minute of rounds, so the
pool's periodic re-check is in the average): it must not grow with the number of workers.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from exporter.bootstrap import bootstrap
from exporter.codecs import normalize, promtext
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.sources.scrape import Scraper, ScrapeTarget

WORKERS = 1000
SMALL = 100
PORTS = 4
INTERVAL_S = 5.0
TARGET_SHARE = 0.20
# Per-scrape work at W=1,000 over W=100: ≈ 1 when it does not grow with W (a bigger working set
# costs some cache misses); work linear in W would read about 10 (it read 4.9 before the pool's
# incremental bookkeeping).
TARGET_GROWTH = 2.0
ROUNDS = 5


# ---- the page server (a process of its own) -------------------------------------------------
async def _serve(ports: int, page: bytes) -> None:
    zipped = gzip.compress(page, 5)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                gz = b"accept-encoding:" in lower and b"gzip" in lower.split(b"accept-encoding:", 1)[1].split(b"\r\n", 1)[0]
                body = zipped if gz else page
                close = b"connection: close" in lower
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                             + (b"Content-Encoding: gzip\r\n" if gz else b"")
                             + (b"Connection: close\r\n" if close else b"")
                             + b"Content-Length: %d\r\n\r\n" % len(body) + body)
                await writer.drain()
                if close:
                    break
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    servers = [await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024) for _ in range(ports)]
    print(json.dumps([s.sockets[0].getsockname()[1] for s in servers]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the parent closes stdin


def serve_main(ports: int) -> None:
    from bench.parse import worker_page

    asyncio.run(_serve(ports, worker_page().encode()))


class PageServer:
    def __init__(self, ports: int = PORTS) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scrape", "--serve", str(ports)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        self.ports: list[int] = json.loads(self.proc.stdout.readline())

    def targets(self, n: int) -> list[ScrapeTarget]:
        return [ScrapeTarget(f"w{i:04d}", f"http://127.0.0.1:{self.ports[i % len(self.ports)]}/w/w{i:04d}/metrics",
                             "worker") for i in range(n)]

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _parts() -> tuple[Health, ClusterState]:
    parts = bootstrap()
    return parts.health, parts.state


# ---- rows -----------------------------------------------------------------------------------
def _round_cpu(server: PageServer) -> tuple[list[float], list[float], int]:
    """CPU seconds and wall seconds of each scrape round over WORKERS targets; targets up."""
    health, state = _parts()
    scraper = Scraper(server.targets(WORKERS), state, health, timeout=INTERVAL_S, interval=INTERVAL_S)
    scraper.scrape_once()  # connections open, the pool is discovered
    cpu, wall = [], []
    up = 0
    for _ in range(ROUNDS):
        c0, w0 = time.process_time(), time.perf_counter()
        outcomes = scraper.scrape_once()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
        up = sum(o.up for o in outcomes)
    scraper.close()
    return cpu, wall, up


def _bare_parse_s(page: str, n: int) -> float:
    t0 = time.process_time()
    for _ in range(n):
        promtext.parse(page, normalize.WORKER_NAMES)
    return time.process_time() - t0


def _per_scrape_work(n_workers: int, rounds: int = 14) -> float:
    """Seconds of ``observe_worker`` per scrape over ``rounds`` rounds 5 s apart (the first not counted)."""
    from bench.parse import worker_page

    snapshot, _ = normalize.parse_worker("w", worker_page())
    snaps = [replace(snapshot, worker=f"w{i:04d}") for i in range(n_workers)]
    _health, state = _parts()
    t = 1.8e9
    spent = 0.0
    for r in range(rounds):
        t0 = time.thread_time()
        for s in snaps:
            state.observe_worker(s, t)
        if r:
            spent += time.thread_time() - t0
        t += INTERVAL_S
    return spent / ((rounds - 1) * n_workers)


def run() -> Iterator[dict[str, Any]]:
    from bench.parse import worker_page

    server = PageServer()
    try:
        cpu, wall, up = _round_cpu(server)
    finally:
        server.close()
    if up != WORKERS:
        raise RuntimeError(f"{up} of {WORKERS} targets up")
    page = worker_page()
    base = statistics.median(_bare_parse_s(page, WORKERS) for _ in range(3))
    round_cpu = statistics.median(cpu)
    share = round_cpu / INTERVAL_S
    yield {"name": f"scrape round, {WORKERS} workers: CPU share of a core at {INTERVAL_S:g} s",
           "value": share, "baseline": base / INTERVAL_S, "ratio": round_cpu / base,
           "target": f"≤ {TARGET_SHARE:.0%}", "ok": share <= TARGET_SHARE}
    yield {"name": f"scrape round, {WORKERS} workers: wall seconds", "value": statistics.median(wall),
           "baseline": None, "ratio": None, "target": f"< {INTERVAL_S:g} s (on time)",
           "ok": max(wall) < INTERVAL_S}
    small = statistics.median(_per_scrape_work(SMALL) for _ in range(3))
    large = statistics.median(_per_scrape_work(WORKERS) for _ in range(3))
    growth = large / small
    yield {"name": f"state work per scrape at W={WORKERS:,} (baseline W={SMALL}), µs", "value": large * 1e6,
           "baseline": small * 1e6, "ratio": growth, "target": f"ratio ≤ {TARGET_GROWTH:g}",
           "ok": growth <= TARGET_GROWTH}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve_main(int(sys.argv[2]))
    else:
        for row in run():
            print(row)
