"""``POST /v1/traces`` on the exporter's port: the OTLP/HTTP trace receiver's thin edge.

OTLP/HTTP (opentelemetry-proto docs/specification.md): the body is an ExportTraceServiceRequest,
``application/x-protobuf`` or ``application/json``, optionally gzip; success is 200 with an
ExportTraceServiceResponse in the same encoding (``partial_success`` when spans were rejected);
a body that does not decode is 400 (never retried), one over the limit (bytes once decompressed,
spans, elements) 413, and one that arrives while the receivers hold their memory limit 429 with
``Retry-After`` (retried).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable

from exporter.codecs import otlp
from exporter.codecs.normalize import worker_names_by_url
from exporter.config import OtlpTraces, WorkerTarget
from exporter.sources.otlp_spans import ExportAnswer, Overloaded, SpanIntake
from exporter.web.routes import HttpError, Request, Response

PATH = "/v1/traces"
RETRY_AFTER_S = 1  # an exporter told 429 retries after this (OTLP/HTTP honours Retry-After)


def mapping_for(cfg: OtlpTraces, workers: Iterable[WorkerTarget]) -> otlp.SpanMapping:
    """The span mapping of the config; a worker attribute holding a configured worker's URL (or
    host:port, or its name) maps to that worker's name."""
    workers = list(workers)
    names = worker_names_by_url((w.name, w.metrics_url) for w in workers if w.metrics_url)
    names.update({w.name.lower(): w.name for w in workers})
    return otlp.SpanMapping(span_names=frozenset(cfg.span_names), worker_attributes=cfg.worker_attributes,
                            session_attributes=cfg.session_attributes, cached_attributes=cfg.cached_attributes,
                            adapter_attributes=cfg.adapter_attributes, tenant_attributes=cfg.tenant_attributes,
                            worker_names=names)


def bearer_check(token: str | None) -> Callable[[Request], bool]:
    """The records intake's bearer token applies to traces too (OTEL_EXPORTER_OTLP_TRACES_HEADERS)."""
    def authorised(req: Request) -> bool:
        if token is None:
            return True
        scheme, _, given = (req.header("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())
    return authorised


def handler(intake: SpanIntake, authorised: Callable[[Request], bool]) -> Callable[[Request], Response]:
    def traces(req: Request) -> Response:
        if not authorised(req):
            raise HttpError("missing or wrong bearer token", 401, {"WWW-Authenticate": 'Bearer realm="prefixscope"'})
        length = req.header("Content-Length")
        if length is None or not length.isdigit():
            raise HttpError("Content-Length is required", 411)
        if int(length) > intake.max_body_bytes:
            raise HttpError(f"body of {length} bytes exceeds the limit of {intake.max_body_bytes} bytes", 413)
        try:
            with intake.admit(int(length)):  # the body's memory is held before it is read
                answer = intake.export(req.read_body(int(length)), req.header("Content-Type"),
                                       req.header("Content-Encoding"), admitted=True)
        except Overloaded as exc:
            answer = ExportAnswer(Overloaded.status, otlp.PROTOBUF, reason=str(exc))
        if answer.status != 200:
            headers = {"Retry-After": str(RETRY_AFTER_S)} if answer.status == Overloaded.status else None
            raise HttpError(answer.reason, answer.status, headers)
        return Response(200, answer.body, answer.media)

    return traces
