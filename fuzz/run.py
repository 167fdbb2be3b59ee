"""Fuzz every input edge of the exporter: the KV-event decoder, the Prometheus text parser (worker
pages), router pages, the OTLP trace intake (protobuf and JSON), request records and NATS messages.

``python -m fuzz.run [--inputs N] [--seed S] [--targets a,b] [--server-every K]`` (``make fuzz``;
``FUZZ_ARGS`` passes these) feeds N generated inputs to each target (default 1,000,000 each) and
reports crashes. A crash is any exception other than a target's documented refusal, or an output
that breaks the edge's promise:

* ``kv-decoder``: ``kvcodec.decode_batch`` never raises; a batch it returns holds only hashes and
  parents in 0..2^64-1, positive block sizes and a finite timestamp; the root keys the compiled
  reader reads from the payload of a scanned batch are those of the event path's root stores;
* ``text-parser``: ``promtext.parse`` never raises; every label value it returns passes
  ``exporter.core.labels.valid_label_value``; ``normalize.parse_worker`` (and ``parse_router`` on
  a page it reads) raise only ``UnrecognisedMetrics`` and every number they return is finite;
* ``router-pages``: the routers' own pages (the SGLang gateway, vllm-router, Dynamo, llm-d
  fixtures) mutated, and pages made of the routers' metric and label names, through
  ``normalize.parse_router`` with each router kind: it raises only ``UnrecognisedMetrics``; every
  key it returns is a valid label value, every value and histogram finite;
* ``otlp-protobuf`` and ``otlp-json``: ``SpanIntake.export`` — the one error boundary that
  ``POST /v1/traces`` and gRPC ``Export`` both call, answering what they then send — answers only
  200, 400, 413 or 429; a refusal is counted under ``ingest_errors{source="otlp"}`` and delivers
  nothing; a 200 carries an ExportTraceServiceResponse that parses; every record delivered passes
  the records' own checks (``records.record_problem``: label values, bounds, timestamp). Every
  ``K``-th input (``--server-every``, default 20: 50,000 of a million) is also sent to a running
  exporter on 127.0.0.1 as a client would: ``POST /v1/traces`` with its Content-Type and
  Content-Encoding (gzip), and every other protobuf one through gRPC ``Export`` (gzip as gRPC's
  compression). There any HTTP status outside 200/400/413/429 (a 500 is an escaped exception),
  any gRPC status outside OK/INVALID_ARGUMENT/RESOURCE_EXHAUSTED (UNKNOWN is one), and any scrape
  of ``/metrics`` (one every 250 requests) that is not a 200 page the text parser reads cleanly
  is a crash. The bulk goes in process because a million HTTP round trips on a shared machine
  take hours; the boundary they reach is the same function;
* ``records``: ``records.parse_lines`` never raises, and every record it returns passes the same checks;
* ``nats-messages``: short runs of relayed KV batches (subject, headers, payload, stream
  sequence: junk, duplicate, reordered and absurd sequences, another worker's name, lost headers)
  through ``NatsKvSource``'s handling of the relay's stream, and of Dynamo's messages (its
  runtime's captured bytes and its router's JSON events, mutated) through ``handle_dynamo``:
  nothing raises, no batch it applies is malformed, a worker's sequence never goes back without
  a restart, a restart is passed on only at a message that proves one (the relay's restart
  header, or seq 0 under the worker's own message id), and missed batches stay counts of batches.

Inputs are mutations of the real fixtures (byte flips, splices, truncations, repeats), structured
values shaped like batches, pages, spans and messages with hostile fields, and plain random
bytes. The first few crashing inputs are written to ``fuzz/crashes/`` (``repr`` of the input and
the traceback or the answer). Deterministic for a given seed (but for the running exporter's
clock, which starts at the inputs' own time and then runs).
"""

from __future__ import annotations

import argparse
import base64
import gzip
import json
import logging
import math
import random
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import grpc
import msgpack
import requests
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from exporter.codecs import kvcodec, normalize, otlp, promtext, routers
from exporter.codecs.kv_stream import (
    DEFAULT_PREFIX,
    H_MSG_ID,
    H_RESTART,
    H_SEQ,
    H_WORKER,
    headers_for,
    subject_for,
    worker_from_subject,
)
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
from exporter.model import BlockRemoved, BlockStored, KvBatch
from exporter.sources.kv_nats import MAX_SEQ, NatsKvSettings, NatsKvSource
from exporter.sources.kv_nats import SOURCE as NATS_SOURCE
from exporter.sources.otlp_spans import BodyTooLarge, Overloaded, SpanIntake
from exporter.sources.records import parse_lines, record_problem
from exporter.web.otlp_grpc import PATH
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


def _finite_values(values: dict[object, float], where: str) -> None:
    for key, v in values.items():
        keys = key if isinstance(key, tuple) else (key,)
        assert all(isinstance(k, str) and valid_label_value(k) for k in keys), (where, key)
        assert isinstance(v, float | int) and math.isfinite(v), (where, key, v)


def check_router(page: tuple[str, str, dict[str, str]]) -> None:
    text, kind, worker_names = page
    try:
        snap, _errors = normalize.parse_router("r", text, kind, worker_names)
    except normalize.UnrecognisedMetrics:
        return
    assert snap.kind in routers.BY_KIND, snap.kind
    for name in ("decisions", "healthy", "prefix_outcomes", "sticky_followups", "index_faults"):
        _finite_values(getattr(snap, name), name)
    for name in ("lookup_seconds", "predicted_hit_ratio", "kv_event_lag_seconds"):
        hist = getattr(snap, name)
        if hist is not None:
            assert len(hist.bounds) == len(hist.counts) > 0, (name, hist)
            assert all(math.isfinite(v) for v in (*hist.counts, hist.sum, hist.count)), (name, hist)
    for name in ("regret_selections", "regret_blocks", "routed_requests"):
        v = getattr(snap, name)
        assert v is None or math.isfinite(v), (name, v)


def _check_batch(batch: object) -> None:
    assert isinstance(batch, KvBatch), batch
    assert math.isfinite(batch.ts) and type(batch.seq) is int, batch
    assert isinstance(batch.worker, str) and batch.worker, batch
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= MASK64 for h in ev.hashes), ev
        if isinstance(ev, BlockStored):
            assert ev.parent is None or (type(ev.parent) is int and 0 <= ev.parent <= MASK64), ev
            assert type(ev.block_size) is int and ev.block_size > 0, ev


class _KvSink:
    """What the NATS source hands on, judged as it comes: every batch well formed; per worker, a
    sequence that never goes back unless a restart was passed on first; a restart only at a
    message that proves one (the relay's restart header, or seq 0 under the worker's own message
    id for another batch than its first)."""

    def __init__(self) -> None:
        self.last: dict[str, int] = {}
        self.restarts: list[str] = []
        self.proves = False  # whether the message being handled may prove a restart
        self.relayed = True
        self.problems: list[str] = []  # (the source counts what its sink raises; the check reports it)

    def _judge(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        try:
            _check_batch(batch)
        except AssertionError as exc:
            self._judge(False, f"a malformed batch was applied: {exc}")
        if self.relayed:
            last = self.last.get(batch.worker)
            self._judge(last is None or batch.seq > last, f"worker {batch.worker}: seq {batch.seq} applied after {last}")
            self.last[batch.worker] = batch.seq

    def worker_restarted(self, worker: str) -> None:
        self._judge(not self.relayed or self.proves, f"worker {worker} taken for restarted by a message that proves none")
        self.restarts.append(worker)
        self.last.pop(worker, None)

    def reset_view(self, worker: str) -> None:
        pass

    def view_repaired(self, worker: str) -> None:
        pass


NatsMessage = tuple[str, dict[str, str], bytes, int]  # subject, headers, payload, stream sequence


def check_nats(messages: tuple[bool, list[NatsMessage]]) -> None:
    relayed, batch = messages
    sink, health = _KvSink(), Health()
    sink.relayed = relayed
    src = NatsKvSource(NatsKvSettings(url="nats://127.0.0.1:1", relay=relayed), sink, health, clock=lambda: NOW)
    for subject, headers, data, stream_seq in batch:
        if relayed:
            worker = headers.get(H_WORKER) or worker_from_subject(DEFAULT_PREFIX, subject) or ""
            sink.proves = headers.get(H_RESTART) == "1" or (
                headers.get(H_SEQ) == "0" and headers.get(H_MSG_ID, "").startswith(f"{worker}:0:"))
            src._handle(subject, headers, data, stream_seq)
        else:
            src.handle_dynamo(subject, data)
    assert not sink.problems, sink.problems
    errors = health.snapshot()[0].get("prefixscope_ingest_errors", {})
    assert not errors.get((NATS_SOURCE, "apply")), "applying a batch raised"
    missed = health.total("prefixscope_kv_event_missed_batches") or 0.0
    assert missed <= MAX_SEQ * len(batch), missed


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


ANSWERS = {200, 400, BodyTooLarge.status, Overloaded.status}  # what an export may be answered


def check_otlp(request: tuple[bytes, str, str | None]) -> None:
    body, ctype, encoding = request
    errors_before = _HEALTH.total("prefixscope_ingest_errors") or 0.0
    try:
        answer = INTAKE.export(body, ctype, encoding)  # what POST /v1/traces and gRPC Export call
    finally:
        records, _SINK.records = _SINK.records, []
    assert answer.status in ANSWERS, answer
    if answer.status != 200:
        assert (_HEALTH.total("prefixscope_ingest_errors") or 0.0) > errors_before, "a refusal was not counted"
        assert not records, "a refused request delivered records"
        return
    _parse_response(answer.body, answer.media)
    _check_records(records)


def _parse_response(body: bytes, media: str) -> None:
    if media == otlp.JSON:
        assert isinstance(json.loads(body), dict), body
    else:
        trace_service_pb2.ExportTraceServiceResponse.FromString(body)


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
WORKER_LABELS = ["engine", "model_name", "num_gpu_blocks", "block_size", "tp_rank", "worker", "outcome", "9x", ""]


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


def text_structured(rng: random.Random, names: list[str] = NAMES, label_names: list[str] = WORKER_LABELS) -> str:
    lines = []
    for _ in range(rng.randrange(1, 8)):
        name = rng.choice(names)
        if rng.random() < 0.2:
            lines.append(rng.choice(["# HELP x y", "# TYPE x counter", f"# TYPE {name} histogram", "", "   ", "#"]))
            continue
        labels = ",".join(f'{rng.choice(label_names)}{rng.choice(["=", " = ", ""])}"{_label_value(rng)}"'
                          for _ in range(rng.randrange(0, 4)))
        block = rng.choice([f"{{{labels}}}", f"{{{labels},}}", f"{{{labels}", "", "{}"])
        ts = rng.choice(["", " 1700000000000", " x"])
        lines.append(f"{name}{block} {rng.choice(VALUE_BITS)}{ts}")
    return rng.choice(["\n", "\r\n"]).join(lines)


# Router pages: the routers' own names (with their histograms' series) and label names
ROUTER_NAMES = sorted({f"{n}{suffix}" for n in routers.NAMES for suffix in ("", "_bucket", "_sum", "_count", "_total")})
ROUTER_LABELS = ["worker", "model", "le", "outcome", "result", "policy", "branch", "kind", "reason", "dp_rank",
                 "router_id", "endpoint", "worker_type", "url", "status", "9x", ""]
ROUTER_WORKER_NAMES = {"http://10.0.0.1:8000": "w1", "10.0.0.2:8000": "w2", "\u2028": "w3"}


def _json_leaf(rng: random.Random, value: object) -> object:
    """The value with one leaf (or a whole branch, now and then) replaced by a hostile one."""
    if isinstance(value, dict) and value and rng.random() < 0.85:
        key = rng.choice(list(value))
        if rng.random() < 0.05:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: _json_leaf(rng, value[key])}
    if isinstance(value, list) and value and rng.random() < 0.85:
        i = rng.randrange(len(value))
        return [*value[:i], _json_leaf(rng, value[i]), *value[i + 1:]]
    return _scalar(rng) if rng.random() < 0.8 else rng.choice([[], {}, [value, value], {"stored": value}])


# NATS: relayed batches (subject, headers, payload, stream sequence) and Dynamo's messages
NATS_WORKERS = ["w0", "w1", "w.2", ""]
SEQ_BITS = ["-1", str(2**63), str(2**53 + 1), "x", "", " 3", "1e3", "0x10", "٣", "99999999999999999999999"]


def _relayed(rng: random.Random, kv_seeds: list[bytes]) -> list[NatsMessage]:
    out: list[NatsMessage] = []
    seqs: dict[str, int] = {}
    stream_seq = 0
    for _ in range(rng.randrange(1, 9)):
        worker = rng.choice(NATS_WORKERS[:2])
        seq = seqs.get(worker, rng.choice([0, 0, 5]))
        pick = rng.random()
        if pick < 0.1:  # a restart, as the worker's own stream gives it
            seq = 0
        elif pick < 0.2:  # loss: a jump forward
            seq += rng.choice([2, 100, 1_000_001, 2**40])
        elif pick < 0.3:  # a duplicate or a reordered one
            seq = max(0, seq - rng.randrange(1, 3))
        seqs[worker] = seq + 1
        payload = rng.choice(kv_seeds) if rng.random() < 0.5 else kv_structured(rng)
        if rng.random() < 0.2:
            payload = _mutate(rng, payload, kv_seeds)
        headers = headers_for(worker, seq, payload, restart=rng.random() < 0.03)
        subject = subject_for(DEFAULT_PREFIX, worker)
        hostile = rng.random()
        if hostile < 0.08:
            headers[H_SEQ] = rng.choice(SEQ_BITS)
        elif hostile < 0.12:
            headers[H_WORKER] = rng.choice(NATS_WORKERS)
        elif hostile < 0.15:
            headers.pop(rng.choice(list(headers)))
        elif hostile < 0.18:
            headers[H_MSG_ID] = rng.choice(["", f"{worker}:0:", f"{worker}:0:{rng.randbytes(8).hex()}", "x"])
        elif hostile < 0.2:
            subject = rng.choice([DEFAULT_PREFIX, f"{DEFAULT_PREFIX}.", "other.w0", f"{DEFAULT_PREFIX}.%ZZ"])
        elif hostile < 0.22:
            headers[H_RESTART] = rng.choice(["0", "1", "yes", ""])
        stream_seq = rng.choice([stream_seq + 1, stream_seq + 1, stream_seq + 1, stream_seq, max(0, stream_seq - 1),
                                 stream_seq + 1000])
        out.append((subject, headers, payload, stream_seq))
    return out


def _dynamo(rng: random.Random, seeds: list[object], raw_seeds: list[bytes]) -> list[NatsMessage]:
    out: list[NatsMessage] = []
    for _ in range(rng.randrange(1, 6)):
        pick = rng.random()
        if pick < 0.4:
            data = json.dumps(_json_leaf(rng, rng.choice(seeds)), default=list).encode()  # bytes: a list of ints
        elif pick < 0.6:
            message = _json_leaf(rng, rng.choice(seeds))
            try:
                data = msgpack.packb(message, use_bin_type=True)
            except (OverflowError, TypeError, ValueError):  # a value msgpack cannot hold
                data = b"\xc1"
        elif pick < 0.97:
            data = _mutate(rng, rng.choice(raw_seeds), raw_seeds)
        else:
            data = rng.randbytes(rng.randrange(64))
        out.append(("namespace.dynamo.component.backend.kv_events", {}, data, 0))
    return out


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


# ---- the real receivers: a share of the OTLP inputs over HTTP and gRPC -----------------------
TOKEN = "fuzz-token"
GRPC_OK = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
SCRAPE_EVERY = 250  # requests sent between two scrapes of /metrics
SERVER_EVERY = 20  # one OTLP input in this many is sent to the running exporter as well


class LiveReceivers:
    """A running exporter (its own HTTP server and gRPC receiver on 127.0.0.1) that a share of the
    OTLP inputs is sent to, as a client would: ``POST /v1/traces`` (protobuf or JSON, gzip when the
    input is) and, for protobuf, every other one through gRPC ``Export`` (gzip as gRPC compression).
    A failure is any HTTP answer other than 200/400/413/429 (a 500 is an escaped exception), any
    gRPC status other than OK/INVALID_ARGUMENT/RESOURCE_EXHAUSTED (UNKNOWN is one), and any scrape
    of ``/metrics`` that does not answer 200 with a page the text parser reads without error."""

    def __init__(self) -> None:
        from exporter.config import Config, HttpRecords, OtlpTraces
        from exporter.main import Runtime

        started = time.monotonic()
        cfg = Config(listen_address="127.0.0.1:0", scrape_interval=60.0, scrape_timeout=1.0,
                     otlp=OtlpTraces(session_wait=0.0, grpc_listen_address="127.0.0.1:0"),
                     http_records=HttpRecords(bearer_token=TOKEN))
        # the exporter's clock starts at the inputs' NOW, so their times fall inside its tolerance
        self.runtime = Runtime.build(cfg, clock=lambda: NOW + time.monotonic() - started).start()
        assert self.runtime.grpc is not None
        self.url = f"{self.runtime.url}/v1/traces"
        self.session = requests.Session()
        self.channel = grpc.insecure_channel(self.runtime.grpc.address)
        self.export = self.channel.unary_unary(PATH)  # bytes as they are, like a hostile client
        self.sent = {"http": 0, "grpc": 0, "scrapes": 0}
        self.failures = {"http": 0, "grpc": 0, "scrapes": 0}
        self._turn = 0
        self._protobuf = 0  # protobuf inputs sent: every other one goes through gRPC

    def close(self) -> None:
        self.channel.close()
        self.session.close()
        self.runtime.stop()

    def send(self, request: tuple[bytes, str, str | None]) -> str | None:
        """Send one input; what went wrong, or None."""
        body, ctype, encoding = request
        self._turn += 1
        problem = None
        self._protobuf += ctype == otlp.PROTOBUF
        if ctype == otlp.PROTOBUF and encoding in (None, "gzip") and self._protobuf % 2 == 0:
            self.sent["grpc"] += 1  # gzip is gRPC's own compression there, undone before the intake
            try:
                self.export(gzip.decompress(body) if encoding else body, timeout=60,
                            metadata=(("authorization", f"Bearer {TOKEN}"),),
                            compression=grpc.Compression.Gzip if encoding else None)
            except grpc.RpcError as exc:
                if exc.code() not in GRPC_OK:
                    self.failures["grpc"] += 1
                    problem = f"gRPC Export answered {exc.code()}: {exc.details()}"
        else:
            self.sent["http"] += 1
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": ctype}
            if encoding:
                headers["Content-Encoding"] = encoding
            r = self.session.post(self.url, data=body, headers=headers, timeout=60)
            if r.status_code not in ANSWERS:
                self.failures["http"] += 1
                problem = f"POST /v1/traces answered {r.status_code}: {r.text[:300]}"
        if self._turn % SCRAPE_EVERY == 0:
            problem = self.scrape() or problem
        return problem

    def scrape(self) -> str | None:
        self.sent["scrapes"] += 1
        r = self.session.get(f"{self.runtime.url}/metrics", timeout=60)
        errors = promtext.parse(r.text).errors if r.status_code == 200 else []
        if r.status_code != 200 or errors:
            self.failures["scrapes"] += 1
            return f"/metrics answered {r.status_code}: {(errors or r.text)!r:.300}"
        return None

    def summary(self) -> str:
        return (f"through the running exporter: {self.sent['http']} POST /v1/traces, {self.sent['grpc']} gRPC Export, "
                f"{self.sent['scrapes']} scrapes; failures: {self.failures['http']} HTTP, {self.failures['grpc']} gRPC, "
                f"{self.failures['scrapes']} scrapes")


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
    parser.add_argument("--server-every", type=int, default=SERVER_EVERY,
                        help="send every Nth OTLP input to a running exporter too (0: none)")
    args = parser.parse_args(argv)
    # Rejections are what most inputs get: counted (and checked to be), not logged a million times.
    logging.getLogger("prefixscope.ingest").setLevel(logging.ERROR)
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

    router_seeds = [p.read_bytes() for p in sorted([*(FIXTURES / "routers").glob("*.txt"),
                                                    *FIXTURES.glob("*router_metrics.txt")])]
    router_pieces = [page[i:i + 600] for page in router_seeds for i in range(0, len(page), 300)]

    def router_input() -> tuple[str, str, dict[str, str]]:
        pick = rng.random()
        if pick < 0.4:
            text = text_structured(rng, ROUTER_NAMES, ROUTER_LABELS)
        elif pick < 0.97:
            seed = rng.choice(router_seeds) if pick > 0.95 else rng.choice(router_pieces)
            text = _mutate(rng, seed, router_pieces).decode("utf-8", "surrogateescape")
        else:
            text = rng.randbytes(rng.randrange(0, 200)).decode("utf-8", "surrogateescape")
        return text, rng.choice(routers.KINDS) if rng.random() < 0.3 else "auto", ROUTER_WORKER_NAMES

    dynamo_fixtures = json.loads((FIXTURES / "dynamo_router_events.json").read_text())
    dynamo_seeds = [v for k, v in dynamo_fixtures.items() if not k.startswith("_")]
    capture = json.loads((FIXTURES / "dynamo_runtime_capture.json").read_text())
    dynamo_raw = [json.dumps(v).encode() for v in dynamo_seeds] + [
        bytes.fromhex(m["data"]) for k, v in capture.items() if not k.startswith("_") for m in v["messages"]]

    def nats_input() -> tuple[bool, list[NatsMessage]]:
        if rng.random() < 0.6:
            return True, _relayed(rng, kv_seeds)
        return False, _dynamo(rng, dynamo_seeds, dynamo_raw)

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
        ("router-pages", router_input, check_router),  # type: ignore[list-item]
        ("nats-messages", nats_input, check_nats),  # type: ignore[list-item]
    ]
    chosen = {t for t in args.targets.split(",") if t}
    if chosen - {t[0] for t in every}:
        parser.error(f"unknown targets {sorted(chosen - {t[0] for t in every})}; known: {[t[0] for t in every]}")
    targets = [t for t in every if not chosen or t[0] in chosen]
    counts = dict.fromkeys((t[0] for t in targets), 0)
    crashes = dict.fromkeys(counts, 0)
    otlp_targets = {"otlp-protobuf", "otlp-json"} & set(counts)
    live = LiveReceivers() if otlp_targets and args.server_every > 0 else None
    kept = 0
    started = time.monotonic()

    def keep(name: str, i: int, data: object, what: str) -> None:
        nonlocal kept
        crashes[name] += 1
        if kept < KEEP_CRASHES:
            CRASH_DIR.mkdir(exist_ok=True)
            (CRASH_DIR / f"{name}-{i}.txt").write_text(f"{data!r}\n\n{what}", errors="backslashreplace")
            kept += 1

    try:
        for i in range(args.inputs * len(targets)):
            name, make, check = targets[i % len(targets)]
            data = make()
            counts[name] += 1
            try:
                check(data)
            except Exception:
                keep(name, i, data, traceback.format_exc())
            if live is not None and name in otlp_targets and counts[name] % args.server_every == 0:
                problem = live.send(data)  # type: ignore[arg-type]
                if problem is not None:
                    keep(name, i, data, problem)
            if (i + 1) % 100_000 == 0:
                print(f"{i + 1:>9} inputs, {sum(crashes.values())} crashes, {time.monotonic() - started:.0f}s",
                      flush=True)
        if live is not None:
            problem = live.scrape()
            if problem is not None:
                keep(sorted(otlp_targets)[0], -1, "the last scrape", problem)
    finally:
        if live is not None:
            live.close()
    for name in counts:
        print(f"{name}: {counts[name]} inputs, {crashes[name]} crashes")
    if live is not None:
        print(live.summary())
    total = sum(crashes.values())
    print(f"total: {sum(counts.values())} inputs, {total} crashes in {time.monotonic() - started:.0f}s"
          + (f" (see {CRASH_DIR})" if total else ""))
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
