"""OTLP/gRPC trace receiver: ``TraceService/Export`` on its own port, a thin edge over :class:`SpanIntake`.

vLLM's ``--otlp-traces-endpoint`` exports over gRPC unless ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
says ``http/protobuf``, and sglang-router's ``--otlp-traces-endpoint`` takes a gRPC ``host:port``,
so this is what an unmodified worker or router reaches. It feeds the same intake as
``POST /v1/traces`` (``exporter.web.otlp_http``): one decoding, one span → record mapping, one count
of rejections.

The method is registered with raw bytes in and out rather than through the generated
``trace_service_pb2_grpc`` servicer: its deserializer would refuse a message that does not decode
with ``INTERNAL`` before prefixscope saw it, uncounted. Here the intake decodes it, counts it
(``ingest_errors{source="otlp"}``) and the sender gets ``INVALID_ARGUMENT``, which OTLP exporters
do not retry (opentelemetry-proto docs/specification.md, "OTLP/gRPC Response"). The same for a
message over ``max_body_bytes``: resending it cannot succeed. Spans the intake rejects one by one
come back in the response's ``partial_success`` with the first reasons.

Limits: gRPC itself refuses a message over twice the limit (``RESOURCE_EXHAUSTED``, uncounted:
it is never read into memory); one between the limit and twice it is read, refused and counted.
The limit applies to the decompressed message — gRPC undoes ``grpc-encoding: gzip`` (what
``OTEL_EXPORTER_OTLP_TRACES_COMPRESSION=gzip`` sends) before the intake sees it. The records
intake's bearer token, when set, is required in the ``authorization`` metadata
(``OTEL_EXPORTER_OTLP_TRACES_HEADERS=Authorization=Bearer%20TOKEN``) and checked from the call's
headers, before its message is read; plaintext only (no TLS), as vLLM sends with an ``http://``
endpoint or ``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true``.

Slow or hostile clients: the method is served as request-streaming, so a call is handed to a
thread as soon as its headers arrive and the thread itself waits for the message — for at most
``receive_timeout`` seconds, after which the call is cancelled and counted
(``ingest_errors{source="otlp",kind="timeout"}``). A call that sends headers and never its
message therefore holds a thread for seconds, not for good; ``THREADS`` calls are served at once
and a call beyond them is refused at once with ``RESOURCE_EXHAUSTED`` (retried by exporters);
one connection opens at most ``MAX_STREAMS_PER_CONNECTION`` calls at a time, and a connection
idle for ``IDLE_CONNECTION_S`` is closed. When the receivers hold their memory limit
(``otlp_spans.MemoryLimiter``) the call is refused with ``RESOURCE_EXHAUSTED`` too.
"""

from __future__ import annotations

import hmac
import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from exporter.codecs import otlp
from exporter.sources.otlp_spans import SOURCE, BodyTooLarge, Overloaded, SpanIntake

log = logging.getLogger("prefixscope.otlp_grpc")

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD = "Export"
PATH = f"/{SERVICE}/{METHOD}"
THREADS = 16  # calls served at once (each waits for its message, then decodes and delivers it)
MAX_CONCURRENT_RPCS = THREADS  # beyond this gRPC answers RESOURCE_EXHAUSTED at once, which exporters retry
MAX_STREAMS_PER_CONNECTION = 8  # HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS: one client cannot take every thread
IDLE_CONNECTION_S = 60.0  # a connection with no call for this long is closed
DEFAULT_RECEIVE_TIMEOUT_S = 10.0  # seconds a call has to send its message once its headers are in
# The intake's answer (an HTTP status) as gRPC says it: a refusal that resending cannot fix is
# INVALID_ARGUMENT (not retried by exporters), the memory limit RESOURCE_EXHAUSTED (retried).
STATUS_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, BodyTooLarge.status: grpc.StatusCode.INVALID_ARGUMENT,
                Overloaded.status: grpc.StatusCode.RESOURCE_EXHAUSTED}


def authorised(metadata: tuple[tuple[str, str | bytes], ...], token: str | None) -> bool:
    """The records intake's bearer token in the ``authorization`` metadata (any case of the scheme)."""
    if token is None:
        return True
    given = next((v for k, v in metadata if k.lower() == "authorization"), "")
    if isinstance(given, bytes):
        given = given.decode("latin-1")
    scheme, _, value = given.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())


class GrpcTraceReceiver:
    """``TraceService/Export`` bound at construction (OSError if the address is taken); ``start`` serves."""

    def __init__(self, intake: SpanIntake, address: str, bearer_token: str | None = None,
                 receive_timeout: float = DEFAULT_RECEIVE_TIMEOUT_S) -> None:
        self.intake = intake
        self.token = bearer_token
        self.receive_timeout = receive_timeout
        self.pool = futures.ThreadPoolExecutor(THREADS, thread_name_prefix="prefixscope-otlp-grpc")
        self.server = grpc.server(
            self.pool,
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=[("grpc.max_receive_message_length", 2 * intake.max_body_bytes),
                     ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
                     ("grpc.max_connection_idle_ms", int(IDLE_CONNECTION_S * 1000)),
                     ("grpc.so_reuseport", 0)])
        handler = grpc.stream_unary_rpc_method_handler(self.export)  # bytes in, bytes out; see the module's notes
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, {METHOD: handler}),))
        host = address.rpartition(":")[0]
        try:
            port = self.server.add_insecure_port(address)
        except RuntimeError as exc:  # grpcio raises this when the port cannot be bound
            raise OSError(f"cannot listen on {address}: {exc}") from None
        if not port:
            raise OSError(f"cannot listen on {address}")
        self.address = f"{host}:{port}"

    def start(self) -> GrpcTraceReceiver:
        self.server.start()
        return self

    def stop(self, grace: float = 1.0) -> None:
        """Calls in flight get ``grace`` seconds to finish; new ones are refused at once."""
        self.server.stop(grace).wait(grace + 1.0)
        self.pool.shutdown(wait=False)

    def _receive(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> tuple[bytes | None, bool]:
        """The call's one message (None: the client ended the call without one), and whether the
        receive timeout ran out first (the call is then cancelled)."""
        expired = threading.Event()

        def expire() -> None:
            expired.set()
            context.cancel()

        timer = threading.Timer(self.receive_timeout, expire)
        timer.daemon = True
        timer.start()
        try:
            request = next(requests, None)
        except grpc.RpcError:  # cancelled: by the timer, or by the client
            request = None
        finally:
            timer.cancel()
        return (None, True) if expired.is_set() else (request, False)

    def export(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        if not authorised(tuple(context.invocation_metadata()), self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")  # nothing read yet
        request, expired = self._receive(requests, context)
        if expired:
            self.intake.health.error(SOURCE, "timeout", f"{context.peer()}: no message within "
                                                        f"{self.receive_timeout:g}s of the call's headers")
            return b""
        if request is None:
            if context.is_active():
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Export takes exactly one request message")
            return b""  # the client cancelled: nobody to answer
        answer = self.intake.export(request, otlp.PROTOBUF)  # the one error boundary, as over HTTP
        if answer.status != 200:
            context.abort(STATUS_CODES.get(answer.status, grpc.StatusCode.INVALID_ARGUMENT), answer.reason)
        return answer.body
