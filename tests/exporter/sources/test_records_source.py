"""Record intake: NDJSON parsing against the schema, counting, and the file tailer on real files."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

from exporter.core.health import Health
from exporter.sources import records
from exporter.sources.records import BodyTooLarge, RecordFileTail, deliver, parse_lines, parse_ndjson
from prefixscope.records import RequestRecord

GOOD = {"ts": 1795947861.5, "request_id": "r1", "worker": "w0", "prompt_tokens": 512}
GOOD_LINE = json.dumps({**GOOD, "session_key": "s1", "model": "m", "block_hashes": [1, 2, 2**64 - 1],
                        "cached_tokens": 16, "prefill_s": 0.02, "fallback_tier": None, "migrated_from": None,
                        "admitted_by_affinity": True, "schema": "prefixscope.request/v1"})


def _at_good() -> float:  # the exporter's clock when GOOD arrives: its ts is checked against it
    return GOOD["ts"]


def _line(**kw) -> bytes:
    return json.dumps({**GOOD, **kw}).encode()


class Sink:
    def __init__(self) -> None:
        self.records: list[RequestRecord] = []

    def ingest_records(self, recs: list[RequestRecord], received_at: float) -> None:
        self.records.extend(recs)

    def apply_kv_batch(self, batch, received_at) -> None: ...
    def worker_restarted(self, worker) -> None: ...
    def observe_worker(self, snapshot, scraped_at) -> None: ...
    def observe_router(self, snapshot, scraped_at) -> None: ...


def test_valid_body_with_every_optional_field() -> None:
    full = _line(session_key="s", model="m", block_hashes=[0, 2**64 - 1], block_size=16, cached_tokens=256,
                 predicted_cached_tokens=300, output_tokens=10, ttft_s=0.1, prefill_s=0.05, queue_s=0.0,
                 walk_s=0.001, decision="prefix_hit", fallback_tier="warm_pool", async_wait_s=None,
                 migrated_from="w1", migration_kind="soft", migrate_s=0.2, expert_signature="e1",
                 admitted_by_affinity=True, segment="mobile", schema="prefixscope.request/v1", extra="kept")
    recs, errors = parse_ndjson(b"\n".join([_line(), full, b"", _line(request_id="r3")]) + b"\n", 1 << 20)
    assert errors == []
    assert [r.request_id for r in recs] == ["r1", "r1", "r3"]
    assert all(isinstance(r, RequestRecord) for r in recs)
    assert (recs[1].block_hashes, recs[1].segment, recs[1].migration_kind) == ((0, 2**64 - 1), "mobile", "soft")
    assert recs[1].reports("async_wait_s") and not recs[0].reports("async_wait_s")  # explicit null vs absent


BAD_LINES = [
    (b"{not json", "json"),
    (b"[1, 2]", "not_object"),
    (b'{"ts": NaN, "request_id": "r", "worker": "w", "prompt_tokens": 1}', "json"),
    (_line(prompt_tokens=-1), "schema"),
    (_line(prompt_tokens=1.5), "schema"),
    (_line(prompt_tokens=True), "schema"),
    (_line(ts="yesterday"), "schema"),
    (_line(request_id=""), "schema"),
    (_line(block_hashes=[2**64]), "schema"),
    (_line(block_hashes=[-1]), "schema"),
    (_line(migration_kind="teleport"), "schema"),
    (_line(admitted_by_affinity="yes"), "schema"),
    (_line(segment="x" * 65), "schema"),
    (_line(schema="prefixscope.request/v2"), "schema"),
    (json.dumps({"ts": 1, "request_id": "r", "worker": "w"}).encode(), "schema"),
    (b"\xff\xfe garbage bytes", "json"),
]


@pytest.mark.parametrize(("line", "kind"), BAD_LINES)
def test_each_bad_line_rejected_with_its_kind(line: bytes, kind: str) -> None:
    recs, errors = parse_ndjson(_line() + b"\n" + line + b"\n" + _line(request_id="r2"), 1 << 20)
    assert [r.request_id for r in recs] == ["r1", "r2"]
    assert len(errors) == 1 and errors[0].line == 2 and errors[0].kind == kind


def test_schema_message_names_the_field() -> None:
    _, errors = parse_ndjson(_line(cached_tokens=-3), 1000)
    assert "cached_tokens" in errors[0].error and errors[0].as_dict()["line"] == 1


def test_integral_float_is_not_an_integer_for_an_integer_field() -> None:
    # JSON Schema accepts 512.0 as an integer; the exporter does not (a float count breaks slicing)
    recs, errors = parse_ndjson(_line(prompt_tokens=512.0), 1000)
    assert recs == [] and errors[0].kind == "value" and "expected an integer, got 512.0" in errors[0].error


def test_fast_path_agrees_with_the_full_validator() -> None:
    rng = random.Random(7)
    values = [None, -1, 0, 1, 2.5, 2**64, True, "", "x", "soft", "warm_pool", [1], [-1], {"a": 1}]
    fields = list(records.SCHEMA["properties"])
    for _ in range(3000):
        rec = dict(GOOD)
        for name in rng.sample(fields, 3):
            rec[name] = rng.choice(values)
        if rng.random() < 0.1:
            rec.pop(rng.choice(list(rec)))
        full_ok = not list(records.VALIDATOR.iter_errors(rec))
        assert records.FAST_OK(rec) == full_ok, rec  # fastjsonschema and jsonschema: one answer
        assert (records.validate(rec) is None) == full_ok, rec


def _three_steps(obj: dict) -> RequestRecord | None:
    """What a line takes without the whole-record fast path: schema, strict check, conversion."""
    if records.validate(obj) is not None or records.strict_problem(obj) is not None:
        return None
    return RequestRecord.from_json(obj)


def test_whole_record_fast_path_agrees_with_the_three_steps() -> None:
    rng = random.Random(11)
    values = [None, -1, 0, 1, 2.5, -0.5, 1e16, 2**53, 2**53 + 1, 2**64, 2**64 - 1, True, False, "", "x", "é",
              "\ud800", "x" * 300, "soft", "warm_pool", "prefixscope.request/v1", [], [1], [-1], [1.0], [True],
              [2**64], {"a": 1}, float("inf"), float("nan")]
    fields = [*records.SCHEMA["properties"], "extra"]
    fast_taken = 0
    for _ in range(5000):
        rec = json.loads(GOOD_LINE)
        for name in rng.sample(fields, rng.randint(1, 4)):
            rec[name] = rng.choice(values)
        if rng.random() < 0.1:
            rec.pop(rng.choice(list(rec)))
        fast = records.FAST_RECORD(rec)
        if fast is not None:
            fast_taken += 1
            assert fast == _three_steps(rec), rec
    assert fast_taken > 100  # (records compare with the fields they carried)


def test_lines_the_fast_path_declines_get_the_same_answer() -> None:
    lines = [b'{"ts": 1e400, "request_id": "a", "worker": "w", "prompt_tokens": 1}',
             b'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 1, "x": 1e400}',
             b'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 16.0}',
             b'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 1, "x": NaN}',
             b'{"ts": 1, "request_id": "\xed\xa0\x80", "worker": "w", "prompt_tokens": 1}',
             b'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 1} x',
             b'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 1, "block_hashes": [1, 2.0]}',
             rb'{"ts": 1, "request_id": "a", "worker": "w", "prompt_tokens": 1, "session_key": "\u00e9"}',
             b'{"ts": 1, "request_id": "b", "worker": "w", "prompt_tokens": 1} \r',
             b'{"ts": 1, "request_id": "c", "worker": "w", "prompt_tokens": 1}\x0b']
    recs, errors = parse_lines(lines)
    assert [r.request_id for r in recs] == ["a", "b"]  # the non-ASCII session key is fine; so is a CRLF
    assert [(e.line, e.kind) for e in errors] == [(1, "non_finite"), (2, "non_finite"), (3, "value"),
                                                  (4, "json"), (5, "value"), (6, "json"), (7, "value"),
                                                  (10, "json")]


def test_body_limit() -> None:
    body = _line() * 10
    with pytest.raises(BodyTooLarge) as info:
        parse_ndjson(body, len(body) - 1)
    assert info.value.status == 413 == records.STATUS_TOO_LARGE
    assert len(parse_ndjson(body.replace(b"}{", b"}\n{"), len(body) + 9)[0]) == 10


def test_deliver_counts_accepted_and_rejected_by_kind() -> None:
    sink, health = Sink(), Health()
    recs, errors = parse_ndjson(b"\n".join([_line(), b"{", b"{", _line(prompt_tokens=-1)]), 1 << 20)
    deliver(recs, errors, sink, health, "http", 1.0)
    counters = health.snapshot()[0]
    assert len(sink.records) == 1
    assert counters["prefixscope_records_ingested"] == {("http",): 1.0}
    assert counters["prefixscope_ingest_errors"] == {("records", "json"): 2.0, ("records", "schema"): 1.0}


# ---- the file tailer ------------------------------------------------------------------------
def _ids(sink: Sink) -> list[str]:
    return [r.request_id for r in sink.records]


def test_tail_follows_appends_and_waits_for_partial_lines(tmp_path: Path) -> None:
    path = tmp_path / "records.ndjson"
    sink, health = Sink(), Health()
    tail = RecordFileTail(path, sink, health, clock=_at_good)
    assert tail.poll_once() == 0  # not there yet: no error
    with open(path, "ab") as f:
        f.write(_line(request_id="a") + b"\n" + _line(request_id="b")[:20])
        f.flush()
        assert tail.poll_once() == 1 and _ids(sink) == ["a"]
        f.write(_line(request_id="b")[20:] + b"\n{broken\n")
        f.flush()
        assert tail.poll_once() == 1 and _ids(sink) == ["a", "b"]
    assert health.snapshot()[0]["prefixscope_ingest_errors"] == {("records", "json"): 1.0}
    assert health.snapshot()[0]["prefixscope_records_ingested"] == {("file",): 2.0}
    tail.close()


def test_tail_handles_truncation(tmp_path: Path) -> None:
    path = tmp_path / "r.ndjson"
    path.write_bytes(_line(request_id="a") + b"\n" + _line(request_id="b") + b"\n")
    sink = Sink()
    tail = RecordFileTail(path, sink, Health(), clock=_at_good)
    tail.poll_once()
    path.write_bytes(_line(request_id="c") + b"\n")  # truncated and rewritten, shorter
    tail.poll_once()
    assert _ids(sink) == ["a", "b", "c"]
    tail.close()


def test_tail_handles_rotation_without_losing_lines(tmp_path: Path) -> None:
    path = tmp_path / "r.ndjson"
    sink = Sink()
    tail = RecordFileTail(path, sink, Health(), clock=_at_good)
    with open(path, "ab") as f:
        f.write(_line(request_id="a") + b"\n")
        f.flush()
        tail.poll_once()
        f.write(_line(request_id="b") + b"\n")  # written after the last poll, before rotation
        f.flush()
    os.rename(path, tmp_path / "r.ndjson.1")
    assert tail.poll_once() >= 0  # the path is gone for a moment
    path.write_bytes(_line(request_id="c") + b"\n")
    tail.poll_once()
    assert _ids(sink) == ["a", "b", "c"]
    tail.close()


def test_tail_drops_an_over_long_line_and_resumes(tmp_path: Path) -> None:
    path = tmp_path / "r.ndjson"
    sink, health = Sink(), Health()
    tail = RecordFileTail(path, sink, health, clock=_at_good, max_line_bytes=100)
    with open(path, "ab") as f:
        f.write(b"x" * 150)
        f.flush()
        tail.poll_once()
        f.write(b"y" * 150 + b"\n" + _line(request_id="ok") + b"\n")
        f.flush()
        tail.poll_once()
    assert _ids(sink) == ["ok"]
    assert health.snapshot()[0]["prefixscope_ingest_errors"] == {("records", "line_too_long"): 1.0}
    tail.close()


def test_tail_thread_delivers_and_stops(tmp_path: Path) -> None:
    import time

    path = tmp_path / "r.ndjson"
    path.write_bytes(_line(request_id="a") + b"\n")
    sink = Sink()
    tail = RecordFileTail(path, sink, Health(), clock=_at_good, poll_interval=0.01)
    tail.start()
    deadline = time.monotonic() + 5
    with open(path, "ab") as f:
        f.write(_line(request_id="b") + b"\n")
    while len(sink.records) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    tail.close()
    assert _ids(sink) == ["a", "b"]
    assert tail._thread is not None and not tail._thread.is_alive()


def test_every_shape_agrees_with_the_three_steps() -> None:
    """Shapes (key sequences) are remembered with their conversions: same record as the three
    steps, or the fast path declines, whatever the values."""
    rng = random.Random(13)
    values = [None, -1, 0, 1, 2.5, -0.5, -0.0, 1e16, 2**53, 2**53 + 1, 2**64, 2**64 - 1, True, False, "", "x", "é",
              "x" * 300, "soft", "warm_pool", "prefixscope.request/v1", [], [1], [-1], [1.0], [True], [3, 2**64 - 1],
              [2**64], {"a": 1}, float("inf"), float("nan"), 0.25, 7, 512.0]
    fields = [*records.SCHEMA["properties"], "extra"]
    fast = records._compile_fast_record(records.SCHEMA)
    shapes = []
    for _ in range(40):
        keys = ["ts", "request_id", "worker", "prompt_tokens", *rng.sample(fields, rng.randint(0, 12))]
        rng.shuffle(keys)
        shapes.append(list(dict.fromkeys(keys)))
    taken = 0
    for _ in range(6000):
        good = json.loads(GOOD_LINE)
        rec = {k: good.get(k, 1) for k in rng.choice(shapes)}
        for name in rng.sample(list(rec), rng.randint(0, 3)):
            rec[name] = rng.choice(values)
        got = fast(rec)
        if got is not None:
            want = _three_steps(rec)
            assert want is not None and repr(got) == repr(want) and got.carried == want.carried, rec
        taken += got is not None
    assert taken > 300
