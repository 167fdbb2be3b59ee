"""The fleet as service discovery tells it: refresh each provider, relabel, hand on the worker set.

One thread refreshes every provider at its ``refresh_interval`` (a ``file_sd`` file that changed
is read within ``WATCH_S``), relabels each target with its provider's ``relabel_configs``, turns
it into a worker (``exporter.codecs.discovery.workers``) and, when the set of workers — the
config's own ``workers`` plus the discovered ones — differs from the last one handed on, calls
``on_change`` with it. The config's workers always stay and win a name clash; between providers
the first in config order wins (the other is counted, kind ``duplicate``).

A provider that fails keeps its last good targets (Prometheus does the same): a flaky registry
never empties the fleet. Its failure is counted (``prefixscope_discovery_refresh_failures_total``
and an ingest error of source ``discovery``, logged once per kind) and its
``prefixscope_discovery_last_success_timestamp_seconds`` stops moving — what to alert on.
``prefixscope_discovery_targets{provider}`` is the workers each provider gives now.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

from exporter.codecs.discovery import relabel
from exporter.codecs.discovery.workers import BadTarget, DiscoveredWorker, worker_of
from exporter.config import SdProvider, WorkerTarget
from exporter.core.health import Health
from exporter.sources.discovery.providers import DiscoveryFailed, PartialRefresh, Provider, provider

log = logging.getLogger("prefixscope.discovery")

SOURCE = "discovery"
WATCH_S = 1.0  # how often watched files are checked for changes (a stat each)
FAILURES = "prefixscope_discovery_refresh_failures"
LAST_SUCCESS = "prefixscope_discovery_last_success_timestamp_seconds"
TARGETS = "prefixscope_discovery_targets"

OnChange = Callable[[tuple[WorkerTarget, ...]], None]


def as_target(w: DiscoveredWorker) -> WorkerTarget:
    return WorkerTarget(name=w.name, metrics_url=w.metrics_url, kv_events=w.kv_events, replay=w.replay,
                        topic=w.topic, optional=w.optional, topology=w.topology)


class Discovery:
    """``start()`` refreshes every provider once (so the first worker set is complete), hands it
    on and then follows changes on a thread; ``close()`` stops it."""

    def __init__(self, providers: Iterable[SdProvider], static: tuple[WorkerTarget, ...], on_change: OnChange,
                 health: Health, clock: Callable[[], float] = time.time) -> None:
        self.providers: list[Provider] = [provider(p) for p in providers]
        self.static = static
        self.on_change = on_change
        self.health = health
        self.clock = clock
        self._found: dict[str, list[DiscoveredWorker]] = {}  # provider name -> its workers (last good)
        self._due: dict[str, float] = {}  # provider name -> monotonic time of its next refresh
        self.workers: tuple[WorkerTarget, ...] | None = None  # the last set handed on
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # one refresh round at a time
        for p in self.providers:
            name = p.cfg.name
            self.health.inc(FAILURES, (name,), 0)

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> Discovery:
        self.refresh_once(force=True)
        self._thread = threading.Thread(target=self._run, name="prefixscope-discovery", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        for p in self.providers:
            p.close()

    def forget_series(self) -> None:
        """Drop this manager's per-provider series (a reload replaced it; the new one sets its own)."""
        for p in self.providers:
            self.health.remove(TARGETS, (p.cfg.name,))
            self.health.remove(LAST_SUCCESS, (p.cfg.name,))

    def _run(self) -> None:
        while not self._stop.wait(WATCH_S):
            try:
                self.refresh_once()
            except Exception:  # never let a surprise stop following the fleet
                log.exception("discovery round failed")
                self.health.error(SOURCE, "internal", "discovery round failed; see the log")

    # ---- one round ------------------------------------------------------------------------
    def refresh_once(self, force: bool = False) -> bool:
        """Refresh the providers that are due (all with ``force``); True when the worker set changed
        (and ``on_change`` was called)."""
        with self._lock:
            now = time.monotonic()
            refreshed = False
            for p in self.providers:
                name = p.cfg.name
                if not force and now < self._due.get(name, 0.0) and not p.changed():
                    continue
                self._due[name] = now + p.cfg.refresh_interval
                self._refresh(p)
                refreshed = True
            if not refreshed and self.workers is not None:
                return False
            workers = self._combine()
            if workers == self.workers:
                return False
            before = {w.name for w in self.workers or ()}
            after = {w.name for w in workers}
            self.workers = workers
            joined, left = sorted(after - before), sorted(before - after)
            log.info("discovery: %d worker(s)%s%s", len(workers), f", joined {', '.join(joined)}" if joined else "",
                     f", left {', '.join(left)}" if left else "")
        if self._stop.is_set():  # closed while refreshing (a reload replaced it): its news is stale
            return False
        self.on_change(workers)
        return True

    def _refresh(self, p: Provider) -> None:
        name = p.cfg.name
        try:
            targets = p.refresh()
            failure = None
        except PartialRefresh as partial:
            targets, failure = partial.targets, partial.failure
        except DiscoveryFailed as exc:
            targets, failure = None, exc
        except Exception as exc:  # a provider's bug must not stop the others
            log.exception("discovery %s: refresh failed", name)
            targets, failure = None, DiscoveryFailed("internal", f"{type(exc).__name__}: {exc}")
        if failure is not None:
            self.health.inc(FAILURES, (name,))
            self.health.error(SOURCE, failure.kind, f"{name} ({p.cfg.mechanism}): {failure}")
        if targets is None:
            return  # keep the last good workers
        found: list[DiscoveredWorker] = []
        for labels in targets:
            kept = relabel.apply(p.cfg.relabel, labels)
            if kept is None:
                continue
            try:
                found.append(worker_of(kept))
            except BadTarget as exc:
                self.health.error(SOURCE, "target", f"{name}: {exc} (labels {dict(sorted(kept.items()))})")
        self._found[name] = found
        self.health.set(TARGETS, (name,), float(len(found)))
        if failure is None:
            self.health.set(LAST_SUCCESS, (name,), self.clock())

    def _combine(self) -> tuple[WorkerTarget, ...]:
        out = list(self.static)
        names = {w.name for w in out}
        for p in self.providers:
            for w in self._found.get(p.cfg.name, ()):
                if w.name in names:
                    if not any(s.name == w.name for s in self.static):
                        self.health.error(SOURCE, "duplicate", f"{p.cfg.name}: worker {w.name} is found twice; "
                                          "the first is kept")
                    continue
                names.add(w.name)
                out.append(as_target(w))
        return tuple(out)
