"""Concurrent scrapes of worker and router /metrics → normalised snapshots → the sink.

Every round scrapes all targets at once on one thread (``exporter.sources.http_get``), each
under a hard deadline of ``timeout`` seconds that covers connecting, the headers, the body
and parsing it, so a target that hangs or drips its answer costs only itself. Connections the
targets keep open are reused round after round (one pool per scraper). Redirects are
not followed; bodies are capped at ``max_body_bytes`` (before and after gzip). Each scrape sets
``prefixscope_up{target,kind}`` and ``prefixscope_scrape_duration_seconds{target,kind}``; a
target that fails gets up=0 and an ingest error of its kind (``http_status``, ``redirect``,
``timeout``, ``connect``, ``too_large``, ``garbage``), and nothing raises. Lines and values of
a page that is otherwise fine are rejected one by one (``malformed_line``, ``label_value``,
``bad_value``) and the target stays up. Bytes that are not UTF-8 are kept as surrogate escapes,
so a label value holding them is rejected rather than silently rewritten.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from exporter.codecs import normalize, promtext
from exporter.core.health import Health
from exporter.loops.duty_clock import DutyClock
from exporter.model import StateSink
from exporter.sources import http_get

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
    max_tree_size: int | None = None  # for routers: its --max-tree-size, when not the router's default


@dataclass(frozen=True, slots=True)
class ScrapeOutcome:
    target: ScrapeTarget
    up: bool
    duration: float
    scraped_at: float
    error: str | None = None


ScrapeFailed = http_get.FetchFailed  # one target's scrape failed, with the kind it is counted under


class Scraper:
    """``scrape_once()`` scrapes every target now; ``start()`` repeats it every ``interval``."""

    def __init__(self, targets: Iterable[ScrapeTarget], sink: StateSink, health: Health, *,
                 timeout: float = 2.0, interval: float = 5.0, max_workers: int = 8,
                 max_body_bytes: int = MAX_BODY_BYTES, clock: Callable[[], float] = time.time,
                 duties: DutyClock | None = None) -> None:
        # max_workers is accepted for callers of the thread-pool scraper; one thread serves every target now.
        self.targets = list(targets)
        self._current = frozenset((t.name, t.kind) for t in self.targets)
        for t in self.targets:
            if t.kind not in SOURCES:
                raise ValueError(f"target {t.name}: kind must be worker or router, not {t.kind!r}")
        self.sink = sink
        self.health = health
        self.timeout = timeout
        self.interval = interval
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self.duties = duties or DutyClock()  # each round is one batch of the scrape duty
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # Label sets parsed from the pages, by series text: the next round's pages (and other
        # workers' pages with the same series) look them up instead of parsing them again.
        self._series = promtext.SeriesCache()
        self._lock = threading.Lock()
        self._connections = http_get.ConnectionPool()  # kept-alive connections between rounds
        self.last: dict[str, ScrapeOutcome] = {}
        self.round_started: float | None = None  # time.monotonic() of the latest round's start (liveness)

    def set_targets(self, targets: Iterable[ScrapeTarget]) -> None:
        """Scrape these from the next round on (any thread: discovery, a reload). A target that went
        has its outcome forgotten; its series are the state's to drop."""
        new = list(targets)
        for t in new:
            if t.kind not in SOURCES:
                raise ValueError(f"target {t.name}: kind must be worker or router, not {t.kind!r}")
        names = {t.name for t in new}
        self._current = frozenset((t.name, t.kind) for t in new)
        self.targets = new  # one assignment: a round reads either list whole
        with self._lock:
            for name in [n for n in self.last if n not in names]:
                del self.last[name]

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="prefixscope-scraper", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._thread is None or not self._thread.is_alive():
            self._connections.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            with self.duties.duty("scrape"):
                self.scrape_once()
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - started)))

    # ---- scraping -------------------------------------------------------------------------
    def scrape_once(self) -> list[ScrapeOutcome]:
        """Scrape every target now; returns when each has an outcome (by its deadline at the latest)."""
        self.round_started = time.monotonic()
        targets = self.targets  # this round's (set_targets may replace the list meanwhile)
        if type(self)._fetch is not Scraper._fetch:
            # A subclass supplies the pages itself (the lab renders simulated engines): one after
            # another, in order, so a simulated run stays deterministic.
            outcomes = []
            for target in targets:
                scraped_at, started = self.clock(), time.perf_counter()
                try:
                    page: str | ScrapeFailed = self._fetch(target.url)
                except ScrapeFailed as exc:
                    page = exc
                except Exception as exc:  # never let one target's surprise stop the round
                    log.exception("scrape of %s failed", target.url)
                    page = ScrapeFailed("internal", f"{type(exc).__name__}: {exc}")
                outcomes.append(self._conclude(target, page, scraped_at, started, None))
        else:
            outcomes = self._scrape_http(targets)
        current = {t.name for t in self.targets}
        with self._lock:  # (a target removed during the round keeps no outcome)
            self.last.update((o.target.name, o) for o in outcomes if o.target.name in current)
        return outcomes

    def _scrape_http(self, targets: list[ScrapeTarget]) -> list[ScrapeOutcome]:
        scraped_at, started = self.clock(), time.perf_counter()
        outcomes: list[ScrapeOutcome | None] = [None] * len(targets)

        def done(index: int, body: bytes | ScrapeFailed, deadline: float) -> None:
            page = body if isinstance(body, ScrapeFailed) else body.decode("utf-8", "surrogateescape")
            outcomes[index] = self._conclude(targets[index], page, scraped_at, started, deadline)

        http_get.fetch_all([t.url for t in targets], self.timeout, self.max_body_bytes, ACCEPT, done,
                           pool=self._connections)
        return [o for o in outcomes if o is not None]

    def _fetch(self, url: str) -> str:
        """One page, on its own (a subclass may replace it; then targets are fetched through it in turn)."""
        got: list[bytes | ScrapeFailed] = []
        http_get.fetch_all([url], self.timeout, self.max_body_bytes, ACCEPT, lambda _i, body, _d: got.append(body))
        if isinstance(got[0], ScrapeFailed):
            raise got[0]
        return got[0].decode("utf-8", "surrogateescape")

    def _conclude(self, target: ScrapeTarget, page: str | ScrapeFailed, scraped_at: float, started: float,
                  deadline: float | None) -> ScrapeOutcome:
        """Parse and hand on one fetched page (or count its failure); never raises. A target removed
        while its page was on the way is dropped: it is nobody's series any more."""
        if (target.name, target.kind) not in self._current:
            return ScrapeOutcome(target, False, 0.0, scraped_at, "removed")
        source = SOURCES[target.kind]
        error: str | None = None
        try:
            if isinstance(page, ScrapeFailed):
                raise page
            try:
                if target.kind == "worker":
                    worker, errors = normalize.parse_worker(target.name, page, deadline, self._series)
                else:
                    router, errors = normalize.parse_router(target.name, page, target.router_kind,
                                                            dict(target.worker_names), deadline,
                                                            target.max_tree_size, self._series)
            except normalize.UnrecognisedMetrics as exc:
                raise ScrapeFailed("garbage", str(exc)) from None
            except promtext.ParseTimeout as exc:
                raise ScrapeFailed("timeout", f"not parsed within {self.timeout:g}s: {exc}") from None
            by_kind: dict[str, list[promtext.ParseError]] = {}
            for e in errors:
                by_kind.setdefault(e.kind, []).append(e)
            for kind, errs in by_kind.items():
                self.health.error(source, kind, f"{target.name} ({target.url}): {errs[0]}", len(errs))
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
