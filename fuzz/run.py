"""Fuzz the exporter's input edges: the KV-event decoder, the Prometheus text parser, the OTLP
trace intake (protobuf and JSON) and the request-record parser.

``python -m fuzz.run [--inputs N] [--seed S] [--targets a,b]`` (``make fuzz``) feeds N generated
inputs to each target (default 1,000,000 each) and reports crashes. A crash is any exception
other than a target's documented error, or an output that breaks the edge's promise:

* ``kvcodec.decode_batch`` never raises; a batch it returns holds only hashes and parents in
  0..2^64-1, positive block sizes and a finite timestamp; the root keys the compiled reader reads
  from the payload of a scanned batch are those of the event path's root stores;
* ``promtext.parse`` never raises; every label value it returns passes
  ``exporter.core.labels.valid_label_value``;
* ``normalize.parse_worker`` and ``parse_router`` raise only ``UnrecognisedMetrics``; every
  number they return is finite;
* ``SpanIntake.ingest`` (what ``POST /v1/traces`` and gRPC ``Export`` call) raises only
  ``OtlpDecodeError``, ``BodyTooLarge`` or ``Overloaded`` — each counted under
  ``ingest_errors{source="otlp"}`` — and every record it delivers passes the records' own checks
  (``records.record_problem``: label values, bounds, timestamp);
* ``records.parse_lines`` never raises, and every record it returns passes the same checks.

Inputs are mutations of the real fixtures (byte flips, splices, truncations, repeats), structured
values shaped like batches and pages with hostile fields, and plain random bytes. The first few
crashing inputs are written to ``fuzz/crashes/`` (``repr`` of the input and the traceback).
Deterministic for a given seed.
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import math
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import msgpack
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from exporter.codecs import kvcodec, normalize, otlp, promtext
from exporter.core.health import Health
from exporter.core.index.eviction import is_gpu
from exporter.core.index.prefix_instability import (
    COMPARED_BLOCKS,
    EARLY_SPAN_BLOCKS,
    MIN_SHARED_BLOCKS,
    ROOT_KEYS,
    root_key,
)
from exporter.core.labels import valid_label_value
from exporter.model import BlockRemoved, BlockStored
from exporter.sources.otlp_spans import BodyTooLarge, Overloaded, SpanIntake
from exporter.sources.records import parse_lines, record_problem
from prefixscope.records import RequestRecord

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CRASH_DIR = Path(__file__).resolve().parent / "crashes"
MASK64 = (1 << 64) - 1
KEEP_CRASHES = 20

# ---- checks ----------------------------------------------------------------------------------
def _same_parse(a: promtext.ParseResult, b: promtext.ParseResult) -> bool:
    def norm(r: promtext.ParseResult) -> tuple:
        return ([(n, [(s.labels, repr(s.value), s.timestamp) for s in ss]) for n, ss in r.samples.items()],
                r.errors, r.lines, r.other_names, r.families)
    return norm(a) == norm(b)



def check_kv(payload: bytes) -> None:
    batch = kvcodec.decode_batch(payload, "w", 1)
    if batch is None:
        return
    if type(batch) is kvcodec.ScannedBatch and batch.scan.roots and ROOT_KEYS:
        # the compiled reader's root keys (read from the payload) are the event path's
        got = batch.scan.root_keys(COMPARED_BLOCKS, EARLY_SPAN_BLOCKS, MIN_SHARED_BLOCKS)
        typed = kvcodec.decode_batch(payload, "w", 1, token_ids=True)
        assert typed is not None
        roots = [ev for ev in typed.events if type(ev) is BlockStored and ev.parent is None and ev.hashes
                 and is_gpu(ev.medium)]
        assert got == [root_key(ev) for ev in roots], (got, roots)
    assert math.isfinite(batch.ts), batch.ts
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= MASK64 for h in ev.hashes), ev
        if isinstance(ev, BlockStored):
            assert ev.parent is None or (type(ev.parent) is int and 0 <= ev.parent <= MASK64), ev
            assert type(ev.block_size) is int and ev.block_size > 0, ev


def check_text(text: str) -> None:
    result = promtext.parse(text)
    if promtext.CORE == "compiled":  # the compiled scanner reads what the reference reads
        cache = promtext.SeriesCache()
        for wanted in (None, normalize.WORKER_NAMES):
            want = promtext.parse_reference(text, wanted)
            for got in (promtext.parse(text, wanted), promtext.parse(text, wanted, cache=cache),
                        promtext.parse(text, wanted, cache=cache)):
                assert _same_parse(got, want), (got, want)
    for samples in result.samples.values():
        for s in samples:
            assert all(valid_label_value(v) for v in s.labels.values()), s
            assert isinstance(s.value, float), s
    try:
        snap, _errors = normalize.parse_worker("w", text)
    except normalize.UnrecognisedMetrics:
        return
    for name in snap.__slots__:
        value = getattr(snap, name)
        if isinstance(value, float):
            assert math.isfinite(value), (name, value)
    try:
        router, _errors = normalize.parse_router("r", text)
    except normalize.UnrecognisedMetrics:
        return
    for values in (router.decisions, router.healthy, router.prefix_outcomes):
        assert all(math.isfinite(v) and valid_label_value(k) for k, v in values.items()), values


NOW = 1_700_000_000.0  # the intakes' clock: generated times sit around it
TOLERANCE_S = 900.0


class _Sink:
    """What the OTLP intake delivers, kept for the check (the state is not the target here)."""

    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def ingest_records(self, records: list[RequestRecord], received_at: float) -> None:
        self.records += records

    def signal_seen(self, signal: str, ts: float) -> None:
        pass


_SINK = _Sink()
_HEALTH = Health()
MAPPING = otlp.SpanMapping(session_attributes=("gen_ai.conversation.id", "session.id"),
                           adapter_attributes=("gen_ai.request.model",), tenant_attributes=("tenant",),
                           worker_names={"http://10.0.0.1:8000": "w1"})
INTAKE = SpanIntake(MAPPING, _SINK, _HEALTH, session_wait_s=0.0, clock=lambda: NOW, max_body_bytes=1 << 20,
                    ts_tolerance_s=TOLERANCE_S)


def _check_records(records: list[RequestRecord]) -> None:
    for rec in records:
        problem = record_problem(rec, NOW, TOLERANCE_S)
        assert problem is None, (problem, rec)
        assert all(valid_label_value(v) for v in (rec.worker, rec.model, rec.session_key, rec.lora_name, rec.tenant)
                   if v is not None), rec


def check_otlp(request: tuple[bytes, str, str | None]) -> None:
    body, ctype, encoding = request
    errors_before = _HEALTH.total("prefixscope_ingest_errors") or 0.0
    try:
        INTAKE.ingest(body, ctype, encoding)
    except (otlp.OtlpDecodeError, BodyTooLarge, Overloaded):
        assert (_HEALTH.total("prefixscope_ingest_errors") or 0.0) > errors_before, "a refusal was not counted"
        return
    finally:
        records, _SINK.records = _SINK.records, []
    _check_records(records)


def check_records(lines: list[bytes]) -> None:
    records, errors = parse_lines(lines, now=NOW, ts_tolerance_s=TOLERANCE_S)
    assert len(records) + len(errors) <= len(lines)
    _check_records(records)


# ---- inputs ----------------------------------------------------------------------------------
HOSTILE_SCALARS: list[object] = [0, 1, -1, 2**63, 2**64 - 1, -(2**63), 1.5, float("nan"), float("inf"), True, False,
                                 None, "", "x", "\u2028", b"", b"\x00" * 8, b"\xff" * 40, [], {}, "BlockStored"]
EVENT_TAGS = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 7, None]
LABEL_BITS = ['"', "\\", "\\n", "\\\\", '\\"', "}", "{", ",", "=", " ", "\t", "é", "\u2028", "\x85", "\ud800",
              "\udcff", "a" * 300, "x"]
VALUE_BITS = ["1", "0", "-1", "NaN", "+Inf", "-Inf", "1e308", "1e309", "0x10", "", "1_000", "٣", "nan", "2 3", "4 5 6"]
NAMES = [*sorted(normalize.WORKER_NAMES | normalize.ROUTER_NAMES), "x", "a:b", "9bad", "", "vllm:", "with space"]


def _scalar(rng: random.Random) -> object:
    pick = rng.random()
    if pick < 0.4:
        return rng.choice(HOSTILE_SCALARS)
    if pick < 0.7:
        return rng.getrandbits(rng.choice((8, 32, 63, 64)))
    if pick < 0.85:
        return rng.randbytes(rng.choice((1, 8, 32)))
    return rng.uniform(-1e20, 1e20)


def _hashes(rng: random.Random) -> object:
    if rng.random() < 0.1:
        return _scalar(rng)
    return [_scalar(rng) if rng.random() < 0.1 else rng.getrandbits(64) for _ in range(rng.randrange(0, 5))]


def _event(rng: random.Random) -> object:
    tag = rng.choice(EVENT_TAGS)
    fields: dict[str, object] = {"block_hashes": _hashes(rng), "parent_block_hash": rng.choice([None, _scalar(rng)]),
                                 "token_ids": rng.choice([None, [], list(range(16)), _scalar(rng)]),
                                 "block_size": rng.choice([16, 0, -16, 16.0, None, _scalar(rng)]),
                                 "lora_id": None, "medium": rng.choice(["GPU", "CPU", None, _scalar(rng)])}
    if rng.random() < 0.2:
        fields.pop(rng.choice(list(fields)))
    if rng.random() < 0.5:
        return {"type": tag, **fields}
    return [tag, *list(fields.values())[: rng.randrange(0, len(fields) + 2)]]


def kv_structured(rng: random.Random) -> bytes:
    events = [_event(rng) for _ in range(rng.randrange(0, 6))]
    batch: list[object] = [rng.choice([1.5, 0, -1.0, float("nan"), float("inf"), True, "ts", rng.random() * 2e9]), events]
    if rng.random() < 0.7:
        batch.append(rng.choice([0, None, -1, "0", 2**40]))
    if rng.random() < 0.05:
        batch = rng.choice([{"ts": 1}, events, [batch], "x"])  # type: ignore[list-item]
    return msgpack.packb(batch, use_bin_type=rng.random() < 0.8)


def _mutate(rng: random.Random, data: bytes, pool: list[bytes]) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randrange(1, 6)):
        op = rng.randrange(6)
        if op == 0 and buf:  # flip a byte
            buf[rng.randrange(len(buf))] = rng.randrange(256)
        elif op == 1 and buf:  # cut
            i = rng.randrange(len(buf))
            del buf[i:i + rng.randrange(1, 64)]
        elif op == 2:  # insert hostile bytes
            i = rng.randrange(len(buf) + 1)
            buf[i:i] = rng.choice([b"\xed\xa0\x80", b"\xff", b"\x00", b'"', b"\\", b"{", b"}", b"\n", b"\r", b"\xc1",
                                   b"\xcf\xff\xff\xff\xff\xff\xff\xff\xff", b"\xd3\x80\x00\x00\x00\x00\x00\x00\x00"])
        elif op == 3:  # splice another seed
            other = rng.choice(pool)
            i, j = rng.randrange(len(buf) + 1), rng.randrange(len(other) + 1)
            buf[i:] = other[j:j + rng.randrange(1, 400)]
        elif op == 4 and buf:  # repeat a slice
            i = rng.randrange(len(buf))
            piece = bytes(buf[i:i + rng.randrange(1, 32)])
            buf[i:i] = piece * rng.randrange(1, 50)
        elif op == 5:
            buf = buf[: rng.randrange(len(buf) + 1)]
    return bytes(buf)


def _label_value(rng: random.Random) -> str:
    return "".join(rng.choice(LABEL_BITS) for _ in range(rng.randrange(0, 6)))


def text_structured(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randrange(1, 8)):
        name = rng.choice(NAMES)
        if rng.random() < 0.2:
            lines.append(rng.choice(["# HELP x y", "# TYPE x counter", "", "   ", "#"]))
            continue
        labels = ",".join(f'{rng.choice(["engine", "model_name", "num_gpu_blocks", "block_size", "tp_rank", "worker", "outcome", "9x", ""])}'
                          f'{rng.choice(["=", " = ", ""])}"{_label_value(rng)}"' for _ in range(rng.randrange(0, 4)))
        block = rng.choice([f"{{{labels}}}", f"{{{labels},}}", f"{{{labels}", "", "{}"])
        ts = rng.choice(["", " 1700000000000", " x"])
        lines.append(f"{name}{block} {rng.choice(VALUE_BITS)}{ts}")
    return rng.choice(["\n", "\r\n"]).join(lines)


# OTLP: values shaped like vLLM's and a client's spans, with hostile fields
OTLP_KEYS = ["gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens", "gen_ai.request.id",
             "gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue", "gen_ai.latency.time_in_model_prefill",
             "gen_ai.response.model", "gen_ai.request.model", "gen_ai.usage.cache_read.input_tokens",
             "gen_ai.conversation.id", "session.id", "tenant", "service.instance.id", "service.name", "x", ""]
OTLP_STRINGS = ["w0", "w1", "10.0.0.1:8000", "http://10.0.0.1:8000/", "m", "", " ", "\ud800", "\udfff", "é",
                "\u2028", "a" * 300, "x" * 2000, "cmpl-1", "s1", "0"]
OTLP_NUMBERS: list[object] = [0, 1, 64, 512, -1, 2**53, 2**53 + 1, 2**63 - 1, -(2**63), 1.5, 0.2, 1e15, 1e16, 1.7e308,
                              "Infinity", "-Infinity", "NaN", "1e400", "12", True]
SPAN_NAMES = ["llm_request", "llm_request", "chat m", "http_request", ""]


def _otlp_value(rng: random.Random) -> dict[str, object]:
    pick = rng.random()
    if pick < 0.35:
        n = rng.choice(OTLP_NUMBERS)
        if isinstance(n, bool):
            return {"boolValue": n}
        if isinstance(n, int):
            return {"intValue": str(n) if rng.random() < 0.8 else n}
        return {"doubleValue": n}
    if pick < 0.75:
        return {"stringValue": rng.choice(OTLP_STRINGS)}
    if pick < 0.85:
        return {"arrayValue": {"values": [_otlp_value(rng) for _ in range(rng.randrange(0, 3))]}}
    if pick < 0.9:
        return {"kvlistValue": {"values": [{"key": "k", "value": _otlp_value(rng)}]}}
    return rng.choice([{}, {"bytesValue": "AAE="}, {"other": 1}, None, [], "x"])  # type: ignore[list-item]


def _otlp_attrs(rng: random.Random, n: int) -> list[object]:
    out: list[object] = [{"key": rng.choice(OTLP_KEYS), "value": _otlp_value(rng)} for _ in range(n)]
    if rng.random() < 0.05:
        out.append(rng.choice([{"value": {"intValue": "1"}}, {"key": 7, "value": {}}, "x", None]))
    return out


def _otlp_time(rng: random.Random) -> object:
    ns = int(NOW * 1e9)
    return rng.choice([str(ns), str(ns - rng.randrange(10**12)), str(ns + 10**17), "0", "", "-1", "1e18",
                       str(2**64), str(2**64 - 1), ns, 1.5e18, None, "x"])


def _hex_id(rng: random.Random, size: int) -> object:
    if rng.random() < 0.9:
        return rng.randbytes(size).hex()
    return rng.choice(["", "zz" * size, "ab", rng.randbytes(size + 1).hex(), rng.randbytes(size).hex().upper(), 5])


def otlp_json_request(rng: random.Random) -> dict[str, object]:
    spans = []
    trace = _hex_id(rng, 16)
    for _ in range(rng.randrange(0, 5)):
        spans.append({"traceId": trace if rng.random() < 0.6 else _hex_id(rng, 16), "spanId": _hex_id(rng, 8),
                      "parentSpanId": rng.choice(["", _hex_id(rng, 8)]), "name": rng.choice(SPAN_NAMES),
                      "kind": rng.choice([1, 2, 3]), "startTimeUnixNano": _otlp_time(rng),
                      "endTimeUnixNano": _otlp_time(rng), "attributes": _otlp_attrs(rng, rng.randrange(0, 8))})
    return {"resourceSpans": [{"resource": {"attributes": _otlp_attrs(rng, rng.randrange(0, 3))},
                               "scopeSpans": [{"scope": {"name": "vllm.tracing.otel"}, "spans": spans}]}
                              for _ in range(rng.randrange(1, 3))]}


def _json_to_protobuf(request: dict[str, object]) -> bytes | None:
    """The same request in protobuf, where its values fit protobuf's types (else None)."""
    from google.protobuf import json_format

    def ids(value: object) -> object:
        if isinstance(value, dict):
            return {k: (base64.b64encode(bytes.fromhex(v)).decode() if k in ("traceId", "spanId", "parentSpanId")
                        and isinstance(v, str) else ids(v)) for k, v in value.items()}
        if isinstance(value, list):
            return [ids(v) for v in value]
        return value

    try:
        msg = json_format.ParseDict(ids(request), trace_service_pb2.ExportTraceServiceRequest())
        return msg.SerializeToString()
    except Exception:  # a value protobuf cannot hold: the JSON target has it
        return None


def _encode(rng: random.Random, body: bytes, ctype: str) -> tuple[bytes, str, str | None]:
    if rng.random() < 0.1:
        return gzip.compress(body, compresslevel=1), ctype, "gzip"
    if rng.random() < 0.01:
        return body, rng.choice(["text/plain", "application/json; charset=utf-8", ""]), rng.choice([None, "br"])
    return body, ctype, None


def _pb_bomb(rng: random.Random) -> bytes:
    """Many tiny elements in few bytes: spans, attributes, nested arrays."""
    from google.protobuf.internal.encoder import _VarintBytes as varint
    n = rng.choice([10, 10_001, 200_000])
    inner = rng.choice([b"\x12\x00", b"\x4a\x00", b"\x2a\x00"]) * n  # spans, or fields that are no span
    scope = b"\x12" + varint(len(inner)) + inner
    return b"\x0a" + varint(len(scope)) + scope


RECORD_FIELDS = {"ts": [NOW, NOW - 5, NOW + 899, NOW + 10**9, NOW * 1000, -1, 1e400, "x", None, True, 2**64],
                 "request_id": ["r1", "", "\ud800", "x" * 300, 7, None],
                 "worker": ["w0", "", "\udfff", "w" * 257, 1.5, None],
                 "prompt_tokens": [10, 0, -1, 2**53, 2**53 + 1, 1.7e308, 16.0, "10", None, 10**400],
                 "cached_tokens": [5, 20, -1, 1.5, None, 2**70],
                 "model": ["m", "\ud800", "m" * 257, None, 5],
                 "session_key": ["s", "s" * 513, "\udbff", None],
                 "ttft_s": [0.1, -0.1, 1e16, 1e400, None, "0.1"],
                 "block_hashes": [[1, 2, 3], [-1], [2**64], [1.5], "x", None, [[1]]],
                 "segment": ["a", "\ud800", None, "s" * 65],
                 "fallback_tier": ["warm_pool", "other", None],
                 "tenant": ["t", "\udc00", None]}


def record_line(rng: random.Random) -> bytes:
    rec = {k: rng.choice(v) for k, v in RECORD_FIELDS.items() if rng.random() < (0.95 if k in
                                                                                   ("ts", "request_id", "worker", "prompt_tokens") else 0.3)}
    if rng.random() < 0.05:
        rec["nested"] = json.loads("[" * 40 + "]" * 40)
    text = json.dumps(rec)
    return text.replace('"1e400"', "1e400").replace("10000000000" * 3, "1" + "0" * 400).encode()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inputs", type=int, default=1_000_000, help="generated inputs per target")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--targets", default="", help="comma-separated targets (default: all)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kv_seeds = [p.read_bytes() for p in sorted(FIXTURES.glob("*.msgpack"))]
    text_seeds = [p.read_bytes() for p in sorted(FIXTURES.glob("*.txt"))]
    # Small pieces of the pages keep each input cheap; whole pages are fed now and then.
    text_pieces = [page[i:i + 600] for page in text_seeds for i in range(0, len(page), 300)]

    def kv_input() -> bytes:
        pick = rng.random()
        if pick < 0.45:
            return kv_structured(rng)
        if pick < 0.9:
            return _mutate(rng, rng.choice(kv_seeds), kv_seeds)
        return rng.randbytes(rng.randrange(0, 64))

    def text_input() -> str:
        pick = rng.random()
        if pick < 0.45:
            return text_structured(rng)
        if pick < 0.95:
            seed = rng.choice(text_seeds) if pick > 0.94 else rng.choice(text_pieces)
            return _mutate(rng, seed, text_pieces).decode("utf-8", "surrogateescape")
        return rng.randbytes(rng.randrange(0, 200)).decode("utf-8", "surrogateescape")

    pb_seeds = [(FIXTURES / "sglang_router_spans.binpb").read_bytes()]
    json_seeds = [json.dumps(otlp_json_request(random.Random(i))).encode() for i in range(20)]
    pb_seeds += [b for b in (_json_to_protobuf(otlp_json_request(random.Random(i))) for i in range(40)) if b]

    def otlp_pb_input() -> tuple[bytes, str, str | None]:
        pick = rng.random()
        if pick < 0.4:
            body = _json_to_protobuf(otlp_json_request(rng)) or b""
        elif pick < 0.9:
            body = _mutate(rng, rng.choice(pb_seeds), pb_seeds)
        elif pick < 0.93:
            body = _pb_bomb(rng)
        else:
            body = rng.randbytes(rng.randrange(0, 64))
        return _encode(rng, body, otlp.PROTOBUF)

    def otlp_json_input() -> tuple[bytes, str, str | None]:
        pick = rng.random()
        if pick < 0.5:
            body = json.dumps(otlp_json_request(rng)).encode()
        elif pick < 0.95:
            body = _mutate(rng, rng.choice(json_seeds), json_seeds)
        else:
            body = rng.choice([b"[" * 5000, b"{}", b"null", b'{"resourceSpans": 5}', rng.randbytes(rng.randrange(64))])
        return _encode(rng, body, otlp.JSON)

    record_seeds = [record_line(random.Random(i)) for i in range(20)]

    def records_input() -> list[bytes]:
        lines = []
        for _ in range(rng.randrange(1, 4)):
            pick = rng.random()
            lines.append(record_line(rng) if pick < 0.6 else _mutate(rng, rng.choice(record_seeds), record_seeds)
                         if pick < 0.97 else rng.randbytes(rng.randrange(40)))
        return lines

    every: list[tuple[str, Callable[[], object], Callable[[object], None]]] = [
        ("kv-decoder", kv_input, check_kv),  # type: ignore[list-item]
        ("text-parser", text_input, check_text),  # type: ignore[list-item]
        ("otlp-protobuf", otlp_pb_input, check_otlp),  # type: ignore[list-item]
        ("otlp-json", otlp_json_input, check_otlp),  # type: ignore[list-item]
        ("records", records_input, check_records),  # type: ignore[list-item]
    ]
    chosen = {t for t in args.targets.split(",") if t}
    if chosen - {t[0] for t in every}:
        parser.error(f"unknown targets {sorted(chosen - {t[0] for t in every})}; known: {[t[0] for t in every]}")
    targets = [t for t in every if not chosen or t[0] in chosen]
    counts = dict.fromkeys((t[0] for t in targets), 0)
    crashes = dict.fromkeys(counts, 0)
    kept = 0
    started = time.monotonic()
    for i in range(args.inputs * len(targets)):
        name, make, check = targets[i % len(targets)]
        data = make()
        counts[name] += 1
        try:
            check(data)
        except Exception:
            crashes[name] += 1
            if kept < KEEP_CRASHES:
                CRASH_DIR.mkdir(exist_ok=True)
                (CRASH_DIR / f"{name}-{i}.txt").write_text(f"{data!r}\n\n{traceback.format_exc()}",
                                                           errors="backslashreplace")
                kept += 1
        if (i + 1) % 100_000 == 0:
            print(f"{i + 1:>9} inputs, {sum(crashes.values())} crashes, {time.monotonic() - started:.0f}s", flush=True)
    for name in counts:
        print(f"{name}: {counts[name]} inputs, {crashes[name]} crashes")
    total = sum(crashes.values())
    print(f"total: {sum(counts.values())} inputs, {total} crashes" + (f" (see {CRASH_DIR})" if total else ""))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
