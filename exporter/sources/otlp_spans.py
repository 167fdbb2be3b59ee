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

What a span becomes is checked as a record line is (``records.record_problem``): its label values
(worker, model, session, adapter, tenant) valid UTF-8 within the schema's lengths, its counts and
seconds finite and within the records' bounds, its end time within the clock tolerance
(``records.ts_tolerance``) of the exporter's clock. A span that fails is rejected under the same
kind a record line would be.

Memory: one request may hold ``budget`` spans and elements (checked on the wire, before it is
built, ``otlp.Budget``) and ``max_body_bytes`` once decompressed. Across requests, HTTP and gRPC
alike, a :class:`MemoryLimiter` holds what the requests in flight may cost: a request that would
pass it is refused at once (:class:`Overloaded`: 429 / ``RESOURCE_EXHAUSTED``, which OTLP
exporters retry later) rather than grow the heap. Every failure of decoding or conversion is
inside one boundary: the request or the span is rejected and counted, never an escaped exception.
Request spans waiting for their session keep only the attributes they are read for, and at most
``MAX_PENDING_SPANS`` wait.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from exporter.codecs import otlp
from exporter.core.health import Health
from exporter.loops.duty_clock import DutyClock
from exporter.model import StateSink
from exporter.sources.records import RecordError, deliver, record_problem
from prefixscope.records import DEFAULT_TS_TOLERANCE_S, RequestRecord

log = logging.getLogger("prefixscope.otlp")

SOURCE = "otlp"
TRANSPORT = "otlp"
V = TypeVar("V")
MAX_TRACES = 100_000  # traces whose session is remembered; sessions' last workers likewise
MAX_PENDING_SPANS = 100_000  # request spans waiting for their session; past it the oldest wait ends
DEFAULT_MEMORY_LIMIT = 256 * 1024 * 1024  # what the requests in flight may cost at once
# What one element of a decoded request costs at most: an empty span is ~170 bytes in the
# protobuf runtime and as much again as a Python value; an attribute less.
ITEM_BYTES = 384
MAX_REASON_CHARS = 200  # of a rejection's reason (a schema message quotes the value, however long)
DECODED_PER_BYTE = 4  # the body's bytes once parsed (protobuf and Python copies of its strings)


class BodyTooLarge(ValueError):
    status = 413


class Overloaded(Exception):
    """The requests in flight already hold the memory limit: retry later (429 / RESOURCE_EXHAUSTED)."""

    status = 429


class MemoryLimiter:
    """What the trace receivers' requests in flight may cost, process-wide.

    Each request reserves its estimated cost before it allocates it (the announced body before
    it is read, the decoded request before it is built) and returns it when done; a reservation
    that would pass the limit is refused with :class:`Overloaded`, so the heap never grows past
    it on behalf of the receivers — the OpenTelemetry Collector's memory_limiter, by estimate
    rather than by measuring the heap after the fact.
    """

    def __init__(self, limit_bytes: int = DEFAULT_MEMORY_LIMIT) -> None:
        self.limit_bytes = limit_bytes
        self.in_use = 0
        self.refused = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def hold(self, n: int) -> Iterator[None]:
        with self._lock:
            if self.in_use + n > self.limit_bytes:
                self.refused += 1
                raise Overloaded(f"trace receivers are at their memory limit ({self.limit_bytes} bytes "
                                 f"in flight); retry later")
            self.in_use += n
        try:
            yield
        finally:
            with self._lock:
                self.in_use -= n


@dataclass(frozen=True)
class SpanResult:
    accepted: int  # request records delivered or waiting for their session
    rejected: int
    errors: list[str]


@dataclass(frozen=True)
class ExportAnswer:
    """What one export request is answered, whichever transport carried it: ``status`` is the
    HTTP status (200; 400 a body that does not decode; 413 one over a limit; 429 the receivers
    at their memory limit), ``body`` the ExportTraceServiceResponse in the request's encoding
    (on 200), ``reason`` why it was refused (otherwise)."""

    status: int
    media: str
    body: bytes = b""
    reason: str = ""


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
                 duties: DutyClock | None = None, ts_tolerance_s: float = DEFAULT_TS_TOLERANCE_S,
                 budget: otlp.Budget | None = None, limiter: MemoryLimiter | None = None) -> None:
        self.mapping = mapping
        self.ts_tolerance_s = ts_tolerance_s
        self.budget = budget or otlp.Budget()
        self.limiter = limiter or MemoryLimiter()
        self._read = mapping.read
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
        self._waiting = 0  # request spans in _pending
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

    def ingest(self, raw: bytes, content_type: str | None, content_encoding: str | None = None, *,
               admitted: bool = False) -> SpanResult:
        """One export request. Raises OtlpDecodeError (400; BudgetExceeded: 413), BodyTooLarge (413)
        or Overloaded (429), each counted once; nothing else escapes. ``admitted``: the body's own
        memory is held already (:meth:`admit`)."""
        with self.duties.duty("otlp"):
            try:
                with self.limiter.hold(0 if admitted else len(raw)):
                    return self._ingest(raw, content_type, content_encoding)
            except Overloaded as exc:
                self.health.error(SOURCE, "overloaded", str(exc))
                raise

    def export(self, raw: bytes, content_type: str | None, content_encoding: str | None = None, *,
               admitted: bool = False) -> ExportAnswer:
        """One export request answered: the one error boundary ``POST /v1/traces`` and gRPC
        ``Export`` both call (each maps the answer onto its own status codes), so what is
        refused, counted and answered is the same whichever door a request came through."""
        media = otlp.JSON if otlp.media_of(content_type) == otlp.JSON else otlp.PROTOBUF
        try:
            result = self.ingest(raw, content_type, content_encoding, admitted=admitted)
        except Overloaded as exc:
            return ExportAnswer(Overloaded.status, media, reason=str(exc))
        except (BodyTooLarge, otlp.BudgetExceeded) as exc:
            return ExportAnswer(BodyTooLarge.status, media, reason=str(exc))
        except otlp.OtlpDecodeError as exc:
            return ExportAnswer(400, media, reason=str(exc))
        return ExportAnswer(200, media, otlp.response_body(media, result.rejected, "; ".join(result.errors[:3])))

    @contextlib.contextmanager
    def admit(self, announced: int) -> Iterator[None]:
        """Hold the memory an announced body will take while it is read (Overloaded, counted, when it cannot)."""
        try:
            hold = self.limiter.hold(announced)
            hold.__enter__()
        except Overloaded as exc:
            self.health.error(SOURCE, "overloaded", str(exc))
            raise
        try:
            yield
        finally:
            hold.__exit__(None, None, None)

    def _decode(self, raw: bytes, content_type: str | None, content_encoding: str | None) -> list[otlp.Span]:
        try:
            body = self.body(raw, content_encoding)
            with self.limiter.hold(len(body) if body is not raw else 0):
                items = otlp.elements(body, content_type, self.budget)
                with self.limiter.hold(DECODED_PER_BYTE * len(body) + ITEM_BYTES * items):
                    return otlp.decode(body, content_type, self.budget, counted=True)
        except (otlp.OtlpDecodeError, BodyTooLarge) as exc:
            kind = "too_large" if isinstance(exc, BodyTooLarge) else exc.kind
            self.health.error(SOURCE, kind, str(exc))
            raise
        except Overloaded:
            raise
        except Exception as exc:  # the boundary: whatever a hostile body trips is its fault, not a 500
            log.debug("OTLP request failed to decode", exc_info=True)
            self.health.error(SOURCE, "decode", f"{type(exc).__name__}: {exc}")
            raise otlp.OtlpDecodeError(f"not an OTLP ExportTraceServiceRequest: {type(exc).__name__}") from None

    def _ingest(self, raw: bytes, content_type: str | None, content_encoding: str | None) -> SpanResult:
        spans = self._decode(raw, content_type, content_encoding)
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
                        and otlp.session_of(s, self.mapping) is None and self._recordable(s, now):
                    self._pending.setdefault(s.trace_id, []).append(_Pending(s.slim(self._read), now + self.session_wait_s))
                    self._waiting += 1
                else:
                    ready.append(s)
            while self._pending and (len(self._pending) > MAX_TRACES or self._waiting > MAX_PENDING_SPANS):
                oldest = self._pending.popitem(last=False)[1]  # bounded: the oldest wait ends now
                self._waiting -= len(oldest)
                ready += [p.span for p in oldest]
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
            self._waiting -= len(due)
        if due:
            self._deliver(due, now)
        return len(due)

    def pending(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._pending.values())

    # ---- spans → records ------------------------------------------------------------------
    def _recordable(self, span: otlp.Span, now: float) -> bool:
        """Whether the span, as it is, passes for a record (a session would not change that)."""
        try:
            return record_problem(otlp.record_of(span, self.mapping), now, self.ts_tolerance_s) is None
        except Exception:  # rejected, with its reason, when delivered now
            return False

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
        return otlp.record_of(span, self.mapping, key, moved, reports_migrations=True,
                              trace_cached=facts.cached_tokens)

    def _deliver(self, spans: list[otlp.Span], now: float) -> list[str]:
        records: list[RequestRecord] = []
        errors: list[RecordError] = []
        with self._lock:
            for i, span in enumerate(sorted(spans, key=lambda s: s.end_ns), 1):
                try:
                    record = self._record(span)
                except ValueError as exc:
                    errors.append(RecordError(i, "span", str(exc)))
                    continue
                except Exception as exc:  # the boundary: one span's fault never costs the others
                    log.debug("OTLP span %s failed to convert", span.span_id, exc_info=True)
                    errors.append(RecordError(i, "span", f"span {span.span_id or '?'}: {type(exc).__name__}: {exc}"))
                    continue
                problem = record_problem(record, now, self.ts_tolerance_s)
                if problem is not None:
                    why = problem.error if len(problem.error) <= MAX_REASON_CHARS else problem.error[:MAX_REASON_CHARS] + "…"
                    errors.append(RecordError(i, problem.kind, f"span {span.span_id or '?'}: {why}"))
                    continue
                if record.session_key is not None:  # where the session's next request comes from
                    self._remember(self._last_worker, record.session_key, record.worker)
                records.append(record)
        deliver(records, errors, self.sink, self.health, TRANSPORT, now, source=SOURCE)
        return [e.error for e in errors]
