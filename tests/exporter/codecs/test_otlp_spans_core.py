"""The compiled span loop of ``decode_protobuf`` (``_otlp_core.spans_of``) against its reference
(``decode_spans_reference``), and the records check a span's record takes (``records.RECORD_OK``)
against the careful steps: the same spans — ids, names, times, attribute values of every kind,
resource, scope — or the same error, on real, generated and mutated bodies; the same problem,
kind and message for every record."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from exporter.codecs import otlp
from exporter.sources import records
from prefixscope.records import RequestRecord

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
compiled_only = pytest.mark.skipif(otlp._SPANS_OF is None, reason="the compiled span loop is not built")


def _value(rng: random.Random, depth: int = 0) -> common_pb2.AnyValue:
    v = common_pb2.AnyValue()
    kind = rng.choice(("s", "i", "d", "b", "bytes", "none") + (("arr", "kv") if depth < 2 else ()))
    if kind == "s":
        v.string_value = rng.choice(("", "x", "é", "w0", "meta-llama/Llama-3.1-8B-Instruct"))
    elif kind == "i":
        v.int_value = rng.choice((0, 1, -5, 2**62, 512))
    elif kind == "d":
        v.double_value = rng.choice((0.0, 0.25, -1.0, float("inf"), float("nan"), 1e300))
    elif kind == "b":
        v.bool_value = rng.random() < 0.5
    elif kind == "bytes":
        v.bytes_value = rng.randbytes(rng.randrange(4))
    elif kind == "arr":
        v.array_value.values.extend([_value(rng, depth + 1) for _ in range(rng.randrange(3))])
    elif kind == "kv":
        v.kvlist_value.values.extend([common_pb2.KeyValue(key=f"k{i}", value=_value(rng, depth + 1))
                                      for i in range(rng.randrange(3))])
    return v


def _body(rng: random.Random) -> bytes:
    request = trace_service_pb2.ExportTraceServiceRequest()
    for _ in range(rng.randrange(1, 3)):
        rs = request.resource_spans.add()
        rs.resource.attributes.extend([common_pb2.KeyValue(key=f"r{i}", value=_value(rng)) for i in range(3)])
        for _ in range(rng.randrange(0, 3)):
            ss = rs.scope_spans.add()
            ss.scope.name = rng.choice(("", "vllm.tracing.otel"))
            for _ in range(rng.randrange(0, 4)):
                span = trace_pb2.Span(trace_id=rng.choice((rng.randbytes(16), b"", rng.randbytes(5))),
                                      span_id=rng.choice((rng.randbytes(8), b"", rng.randbytes(9))),
                                      parent_span_id=rng.choice((rng.randbytes(8), b"", b"\x01")),
                                      name=rng.choice((otlp.VLLM_SPAN, "other")),
                                      start_time_unix_nano=rng.randrange(2**63), end_time_unix_nano=rng.randrange(2**63))
                keys = [f"a{i}" for i in range(rng.randrange(6))] + ["a0"] * rng.randrange(2)  # a key twice
                span.attributes.extend([common_pb2.KeyValue(key=k, value=_value(rng)) for k in keys])
                ss.spans.append(span)
    return request.SerializeToString()


def _outcome(body: bytes, compiled: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Any]:
    monkeypatch.setattr(otlp, "_SPANS_OF", otlp._SPANS_OF if compiled else None)
    try:
        return ("ok", [repr(s) for s in otlp.decode_protobuf(body)])  # repr: NaN is not equal to itself
    except otlp.OtlpDecodeError as exc:
        return ("error", str(exc))


@compiled_only
def test_spans_equal_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.otlp import export_body

    rng = random.Random(17)
    bodies = [(FIXTURES / "sglang_router_spans.binpb").read_bytes(), export_body(rng, "w0", 1.7e9)]
    bodies += [_body(rng) for _ in range(300)]
    errors = 0
    for body in bodies:
        for b in (body, body[:rng.randrange(len(body) + 1)]):
            want = _outcome(b, False, monkeypatch)
            assert _outcome(b, True, monkeypatch) == want, b
            errors += want[0] == "error"
    assert errors > 10  # ids of the wrong length and cut bodies were among them


def _records(rng: random.Random) -> list[RequestRecord]:
    good = RequestRecord(1.7e9, "cmpl-1", "w0", 512, model="m", cached_tokens=16, output_tokens=20, ttft_s=0.1,
                         queue_s=0.01, prefill_s=0.05, session_key="s1", migrated_from=None,
                         carried=frozenset({"model", "cached_tokens", "migrated_from"}))
    values: list[Any] = [None, -1, 0, 1, 0.5, -0.5, 1e16, float("inf"), float("nan"), 2**53, 2**53 + 1, True, "",
                         "x", "é", "\ud800", "x" * 300, "x" * 1100, "hard", "warm_pool", "prefixscope.request/v1",
                         (), (1, 2), (2**64 - 1,), (2**64,), (-1,), (1.0,), [3]]
    names = [n for n in records._RECORD_FIELDS if n != "carried"]
    out = [good]
    for _ in range(4000):
        rec = good
        for name in rng.sample(names, rng.randint(1, 3)):
            rec = replace(rec, **{name: rng.choice(values)})
        out.append(rec)
    return out


@pytest.mark.skipif(records.RECORD_OK is None, reason="the schema outgrew the struct")
def test_record_problem_equals_the_careful_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(23)
    recs = _records(rng)
    taken = 0
    for rec in recs:
        for now in (None, 1.7e9, 1.7e9 + 5000):
            got = records.record_problem(rec, now)
            monkeypatch.setattr(records, "RECORD_OK", None)
            want = records.record_problem(rec, now)
            monkeypatch.undo()
            assert got == want, rec
        taken += records.RECORD_OK(rec)  # type: ignore[misc]
    assert taken > 200


@pytest.mark.skipif(otlp._MAKE_RECORD is None, reason="the compiled slot setter is not built")
def test_span_records_built_by_slots_equal_the_constructor(monkeypatch: pytest.MonkeyPatch) -> None:
    from bench.otlp import export_body

    rng = random.Random(29)
    spans = otlp.decode_protobuf(export_body(rng, "w0", 1.7e9))
    mapping = otlp.SpanMapping(session_attributes=("session.id",), adapter_attributes=(otlp.REQUEST_MODEL,))
    cases = [(s, kw) for s in spans[:64] for kw in ({}, {"session_key": "s1", "migrated_from": "w2",
                                                          "reports_migrations": True, "trace_cached": 7})]
    built = [otlp.record_of(s, mapping, **kw) for s, kw in cases]
    monkeypatch.setattr(otlp, "_MAKE_RECORD", None)
    constructed = [otlp.record_of(s, mapping, **kw) for s, kw in cases]
    assert [(repr(r), r.carried) for r in built] == [(repr(r), r.carried) for r in constructed]
