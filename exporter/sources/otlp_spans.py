"""OTLP request spans → request records, through the same path records take (``records.deliver``).

Decoding and the span → record mapping are pure (``exporter.codecs.otlp``); this adapter adds what
needs memory across export requests:

- **sessions (and cached tokens) by trace**: vLLM's span carries no session and no cached
  count, but it shares its trace with the client's or router's span (both routers forward
  ``traceparent``), which may carry both (``otlp.trace_facts``). That span usually ends — and is
  exported — after the engine's, so a request span waits up to ``session_wait_s`` for a session
  attribute of its trace before it is delivered without one. Only when ``session_attributes``
  are configured; otherwise spans are delivered at once. A span that cannot become a record (no
  prompt tokens, no worker) does not wait: it is rejected in the response of the export that
  carried it, whatever the session settings.
- **migrations**: for a keyed session, a follow-up served by another worker while the previous
  one is not healthy (``is_healthy``) is a migration from it (kind ``hard``: the exporter sees
  a failed or drained worker, not the router's reason). Every keyed record says whether it
  migrated, so the signal reads 0 rather than missing while nothing moves.

A body that does not decode is refused whole (400) and counted once; a span that is not a
request is skipped; a request span without prompt tokens or worker is rejected and counted
(``ingest_errors{source="otlp"}``) and the rest are kept.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from exporter.codecs import otlp
from exporter.core.health import Health
from exporter.loops.duty_clock import DutyClock
from exporter.model import StateSink
from exporter.sources.records import RecordError, deliver
from prefixscope.records import RequestRecord

SOURCE = "otlp"
TRANSPORT = "otlp"
V = TypeVar("V")
MAX_TRACES = 100_000  # traces whose session is remembered; sessions' last workers likewise


class BodyTooLarge(ValueError):
    status = 413


@dataclass(frozen=True)
class SpanResult:
    accepted: int  # request records delivered or waiting for their session
    rejected: int
    errors: list[str]


@dataclass
class _Pending:
    span: otlp.Span
    deadline: float


class SpanIntake:
    """``ingest(body, content_type, content_encoding)`` per export request; ``flush_due()`` delivers
    request spans whose wait for a session is over (``start()`` runs it in the background)."""

    def __init__(self, mapping: otlp.SpanMapping, sink: StateSink, health: Health, *,
                 is_healthy: Callable[[str], bool] = lambda _w: True, session_wait_s: float = 2.0,
                 max_body_bytes: int = 8 * 1024 * 1024, clock: Callable[[], float] = time.time,
                 duties: DutyClock | None = None) -> None:
        self.mapping = mapping
        self.duties = duties or DutyClock()  # each export request (and each due flush) is one batch of otlp
        self.sink = sink
        self.health = health
        self.is_healthy = is_healthy
        self.session_wait_s = session_wait_s if mapping.session_attributes else 0.0
        self.max_body_bytes = max_body_bytes
        self.clock = clock
        self._lock = threading.Lock()
        self._trace_facts: OrderedDict[str, otlp.TraceFacts] = OrderedDict()
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        self._pending: OrderedDict[str, list[_Pending]] = OrderedDict()  # trace id -> request spans
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self.session_wait_s > 0:
            self._thread = threading.Thread(target=self._run, name="prefixscope-otlp-sessions", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.flush_due(force=True)

    def _run(self) -> None:
        while not self._stop.wait(min(0.5, self.session_wait_s / 2)):
            if self._pending:  # (read without the lock: a flush that starts a round late is harmless)
                with self.duties.duty("otlp"):
                    self.flush_due()

    # ---- intake ---------------------------------------------------------------------------
    def body(self, raw: bytes, content_encoding: str | None) -> bytes:
        """The body with its transfer encoding undone; BodyTooLarge past the limit (before and after)."""
        if len(raw) > self.max_body_bytes:
            raise BodyTooLarge(f"body of {len(raw)} bytes exceeds the limit of {self.max_body_bytes} bytes")
        enc = (content_encoding or "identity").strip().lower()
        if enc == "identity":
            return raw
        if enc != "gzip":
            raise otlp.OtlpDecodeError(f"unsupported Content-Encoding {content_encoding!r}")
        try:
            d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            out = d.decompress(raw, self.max_body_bytes + 1)
        except (zlib.error, gzip.BadGzipFile) as exc:
            raise otlp.OtlpDecodeError(f"gzip body does not decompress: {exc}") from None
        if len(out) > self.max_body_bytes:
            raise BodyTooLarge(f"body exceeds the limit of {self.max_body_bytes} bytes once decompressed")
        return out

    def ingest(self, raw: bytes, content_type: str | None, content_encoding: str | None = None) -> SpanResult:
        """One export request. Raises OtlpDecodeError (400) or BodyTooLarge (413), counted once."""
        with self.duties.duty("otlp"):
            return self._ingest(raw, content_type, content_encoding)

    def _ingest(self, raw: bytes, content_type: str | None, content_encoding: str | None) -> SpanResult:
        try:
            spans = otlp.decode(self.body(raw, content_encoding), content_type)
        except (otlp.OtlpDecodeError, BodyTooLarge) as exc:
            self.health.error(SOURCE, "too_large" if isinstance(exc, BodyTooLarge) else "decode", str(exc))
            raise
        now = self.clock()
        ready: list[otlp.Span] = []
        requests = [s for s in spans if otlp.is_request(s, self.mapping)]
        with self._lock:
            for trace, facts in otlp.trace_facts(spans, self.mapping).items():
                known = self._trace_facts.get(trace)
                self._remember(self._trace_facts, trace, known.merged(facts) if known is not None else facts)
                if self._trace_facts[trace].session_key is not None:
                    ready += [p.span for p in self._pending.pop(trace, ())]
            for s in requests:
                known = self._trace_facts.get(s.trace_id)
                # a span that can never be a record is rejected now, in this export's response
                # (its session would change nothing), not later when its wait ends
                if self.session_wait_s > 0 and (known is None or known.session_key is None) \
                        and otlp.session_of(s, self.mapping) is None and self._recordable(s):
                    self._pending.setdefault(s.trace_id, []).append(_Pending(s, now + self.session_wait_s))
                else:
                    ready.append(s)
            while len(self._pending) > MAX_TRACES:  # bounded: the oldest wait ends now
                ready += [p.span for p in self._pending.popitem(last=False)[1]]
        if requests:
            self.sink.signal_seen("otlp_spans", now)
        rejected = self._deliver(ready, now)
        return SpanResult(len(requests) - len(rejected), len(rejected), rejected[:50])

    def flush_due(self, force: bool = False) -> int:
        """Deliver request spans whose wait for a session is over; returns how many."""
        now = self.clock()
        due: list[otlp.Span] = []
        with self._lock:
            for trace in list(self._pending):
                waiting = self._pending[trace]
                if force or waiting[0].deadline <= now:
                    due += [p.span for p in self._pending.pop(trace)]
        if due:
            self._deliver(due, now)
        return len(due)

    def pending(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._pending.values())

    # ---- spans → records ------------------------------------------------------------------
    def _recordable(self, span: otlp.Span) -> bool:
        try:
            otlp.record_of(span, self.mapping)
        except ValueError:
            return False
        return True

    @staticmethod
    def _remember(table: OrderedDict[str, V], key: str, value: V) -> None:
        table[key] = value
        table.move_to_end(key)
        if len(table) > MAX_TRACES:
            table.popitem(last=False)

    def _record(self, span: otlp.Span) -> RequestRecord:
        facts = self._trace_facts.get(span.trace_id) or otlp.TraceFacts()
        key = otlp.session_of(span, self.mapping) or facts.session_key
        if key is None:
            return otlp.record_of(span, self.mapping, trace_cached=facts.cached_tokens)
        worker = self.mapping.worker(str(span.attr(self.mapping.worker_attributes) or ""))
        prev = self._last_worker.get(key)
        moved = otlp.migration_source(prev, worker, prev is not None and self.is_healthy(prev))
        rec = otlp.record_of(span, self.mapping, key, moved, reports_migrations=True,
                             trace_cached=facts.cached_tokens)
        self._remember(self._last_worker, key, rec.worker)
        return rec

    def _deliver(self, spans: list[otlp.Span], now: float) -> list[str]:
        records: list[RequestRecord] = []
        errors: list[RecordError] = []
        with self._lock:
            for i, span in enumerate(sorted(spans, key=lambda s: s.end_ns), 1):
                try:
                    records.append(self._record(span))
                except ValueError as exc:
                    errors.append(RecordError(i, "span", str(exc)))
        deliver(records, errors, self.sink, self.health, TRANSPORT, now)
        return [e.error for e in errors]
