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
(``OTEL_EXPORTER_OTLP_TRACES_HEADERS=Authorization=Bearer%20TOKEN``); plaintext only (no TLS), as
vLLM sends with an ``http://`` endpoint or ``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true``.
"""

from __future__ import annotations

import hmac
import logging
from concurrent import futures

import grpc

from exporter.codecs import otlp
from exporter.sources.otlp_spans import BodyTooLarge, SpanIntake

log = logging.getLogger("prefixscope.otlp_grpc")

SERVICE = "opentelemetry.proto.collector.trace.v1.TraceService"
METHOD = "Export"
PATH = f"/{SERVICE}/{METHOD}"
THREADS = 4  # export calls decoded at once; each holds the state lock only to deliver
MAX_CONCURRENT_RPCS = 64  # beyond this gRPC answers RESOURCE_EXHAUSTED, which exporters retry


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

    def __init__(self, intake: SpanIntake, address: str, bearer_token: str | None = None) -> None:
        self.intake = intake
        self.token = bearer_token
        self.pool = futures.ThreadPoolExecutor(THREADS, thread_name_prefix="prefixscope-otlp-grpc")
        self.server = grpc.server(
            self.pool,
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
            options=[("grpc.max_receive_message_length", 2 * intake.max_body_bytes),
                     ("grpc.so_reuseport", 0)])
        handler = grpc.unary_unary_rpc_method_handler(self.export)  # bytes in, bytes out
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

    def export(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        if not authorised(tuple(context.invocation_metadata()), self.token):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        try:
            result = self.intake.ingest(request, otlp.PROTOBUF)
        except (otlp.OtlpDecodeError, BodyTooLarge) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return otlp.response_body(otlp.PROTOBUF, result.rejected, "; ".join(result.errors[:3]))
