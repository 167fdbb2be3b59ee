"""Concurrent scrapes of worker and router /metrics → normalised snapshots → the sink.

A small thread pool scrapes every target each round with a per-target deadline (connect, each
read and the whole body). Each scrape sets ``prefixscope_up{target,kind}`` and
``prefixscope_scrape_duration_seconds{target,kind}``; a target that fails, hangs or answers
with something that is not a worker's or router's metrics page gets up=0 and an ingest error
of its kind (``http_status``, ``timeout``, ``connect``, ``garbage``), and never raises.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import requests

from exporter import normalize
from exporter.health import Health
from exporter.model import StateSink

log = logging.getLogger("prefixscope.scrape")

ACCEPT = "text/plain;version=0.0.4;q=0.9,*/*;q=0.1"
MAX_BODY_BYTES = 32 * 1024 * 1024
SOURCES = {"worker": "worker_metrics", "router": "router_metrics"}


@dataclass(frozen=True, slots=True)
class ScrapeTarget:
    name: str
    url: str
    kind: str  # "worker" or "router"
    router_kind: str = "auto"  # for routers: auto, sglang-router, vllm-router
    # for routers: (worker base URL, worker name) pairs, so router series carry the worker's name
    worker_names: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class ScrapeOutcome:
    target: ScrapeTarget
    up: bool
    duration: float
    scraped_at: float
    error: str | None = None


class ScrapeFailed(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Scraper:
    """``scrape_once()`` scrapes every target now; ``start()`` repeats it every ``interval``."""

    def __init__(self, targets: Iterable[ScrapeTarget], sink: StateSink, health: Health, *,
                 timeout: float = 2.0, interval: float = 5.0, max_workers: int = 8,
                 clock: Callable[[], float] = time.time) -> None:
        self.targets = list(targets)
        for t in self.targets:
            if t.kind not in SOURCES:
                raise ValueError(f"target {t.name}: kind must be worker or router, not {t.kind!r}")
        self.sink = sink
        self.health = health
        self.timeout = timeout
        self.interval = interval
        self.clock = clock
        self._pool = ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(self.targets) or 1)),
                                        thread_name_prefix="prefixscope-scrape")
        self._local = threading.local()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.last: dict[str, ScrapeOutcome] = {}

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefixscope-scraper", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self.scrape_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    # ---- scraping -------------------------------------------------------------------------
    def scrape_once(self) -> list[ScrapeOutcome]:
        outcomes = list(self._pool.map(self._scrape, self.targets))
        with self._lock:
            self.last.update((o.target.name, o) for o in outcomes)
        return outcomes

    def _session(self) -> requests.Session:
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            session.headers["Accept"] = ACCEPT
        return session

    def _fetch(self, url: str) -> str:
        deadline = time.monotonic() + self.timeout
        try:
            with self._session().get(url, timeout=self.timeout, stream=True) as resp:
                if resp.status_code != 200:
                    raise ScrapeFailed("http_status", f"HTTP {resp.status_code}")
                body = bytearray()
                raw = resp.raw
                while True:
                    # read1 returns what has arrived, so the whole-body deadline is checked as it trickles in
                    chunk = raw.read1(65536, decode_content=True)  # gzip from prometheus_client
                    if not chunk:
                        break
                    body += chunk
                    if time.monotonic() > deadline:
                        raise ScrapeFailed("timeout", f"body not complete within {self.timeout:g}s")
                    if len(body) > MAX_BODY_BYTES:
                        raise ScrapeFailed("too_large", f"body exceeds {MAX_BODY_BYTES} bytes")
                return body.decode("utf-8", "replace")
        except requests.Timeout:
            raise ScrapeFailed("timeout", f"no answer within {self.timeout:g}s") from None
        except requests.RequestException as exc:
            raise ScrapeFailed("connect", f"{type(exc).__name__}: {exc}") from None

    def _scrape(self, target: ScrapeTarget) -> ScrapeOutcome:
        source = SOURCES[target.kind]
        scraped_at = self.clock()
        started = time.perf_counter()
        error: str | None = None
        try:
            text = self._fetch(target.url)
            try:
                if target.kind == "worker":
                    worker, errors = normalize.parse_worker(target.name, text)
                else:
                    router, errors = normalize.parse_router(target.name, text, target.router_kind,
                                                            dict(target.worker_names))
            except normalize.UnrecognisedMetrics as exc:
                raise ScrapeFailed("garbage", str(exc)) from None
            if errors:
                self.health.error(source, "malformed_line", f"{target.name} ({target.url}): {errors[0]}", len(errors))
            if target.kind == "worker":
                self.sink.observe_worker(worker, scraped_at)
            else:
                self.sink.observe_router(router, scraped_at)
        except ScrapeFailed as exc:
            error = f"{exc.kind}: {exc}"
            self.health.error(source, exc.kind, f"{target.name} ({target.url}): {exc}")
        except Exception as exc:  # never let one target's surprise stop the round
            log.exception("scrape of %s failed", target.url)
            error = f"internal: {type(exc).__name__}: {exc}"
            self.health.error(source, "internal", f"{target.name} ({target.url}): {type(exc).__name__}: {exc}")
        duration = time.perf_counter() - started
        labels = (target.name, target.kind)
        self.health.set("prefixscope_up", labels, 0.0 if error else 1.0)
        self.health.set("prefixscope_scrape_duration_seconds", labels, duration)
        return ScrapeOutcome(target, error is None, duration, scraped_at, error)
