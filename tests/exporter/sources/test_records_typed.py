"""The typed decoder of record lines (msgspec, ``records.TYPED_RECORD``) against the paths it
sits in front of: over randomized lines — every field, null and absent, wrong types, values at
and past each bound, unknown keys, escapes, non-ASCII text, numbers JSON spells but a float
cannot hold, broken JSON — a line it takes becomes the same record (values and ``carried``),
and a body parses to the same records and the same errors, kinds and messages, with or without it."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from typing import Any

import pytest

from exporter.sources import records
from exporter.sources.records import parse_lines

pytestmark = pytest.mark.skipif(records.TYPED_RECORD is None, reason="the schema outgrew the typed decoder")

GOOD = {"ts": 1795947861.5, "request_id": "r1", "worker": "w0", "prompt_tokens": 512, "session_key": "s1",
        "model": "m", "block_hashes": [1, 2, 2**64 - 1], "cached_tokens": 16, "prefill_s": 0.02,
        "fallback_tier": None, "migrated_from": None, "admitted_by_affinity": True,
        "schema": "prefixscope.request/v1"}
VALUES: list[Any] = [None, -1, 0, 1, 2.5, -0.5, -0.0, 1e15, 1e16, 2**53, 2**53 + 1, 2**63, 2**64 - 1, 2**64, True, False,
                     "", "x", "é", "\u2028", "x" * 257, "x" * 1025, "soft", "hard", "warm_pool", "nope",
                     "prefixscope.request/v1", [], [1], [-1], [1.0], [True], [3, 2**64 - 1], [2**64], [[1]],
                     {"a": 1}, {"a": [{"b": 1}]}, 0.25, 7, 512.0]
RAW = ["1e400", "-1e400", "16.0", "1E2", "-0", "NaN", "Infinity", "01", "1.", '"\\ud800"', '"\\u0041"', '"a\\nb"',
       "[1,]", "{}", '"\\u00e9"']
FIELDS = [*records.SCHEMA["properties"], "extra", "ts2"]


def _line(rng: random.Random) -> bytes:
    rec = dict(GOOD)
    for name in rng.sample(FIELDS, rng.randint(0, 4)):
        rec[name] = rng.choice(VALUES)
    for _ in range(rng.choice((0, 0, 1))):
        rec.pop(rng.choice(list(rec)))
    keys = list(rec)
    if rng.random() < 0.3:
        rng.shuffle(keys)
    text = json.dumps({k: rec[k] for k in keys}, ensure_ascii=rng.random() < 0.5,
                      separators=rng.choice(((",", ":"), (", ", ": "))))
    if rng.random() < 0.2:  # a value as JSON spells it, not as json.dumps would
        name = rng.choice(keys)
        text = text.replace(json.dumps(name) + ":" + json.dumps(rec[name]), json.dumps(name) + ":" + rng.choice(RAW), 1)
    if rng.random() < 0.05:
        text = text[:rng.randrange(len(text))]  # cut short
    if rng.random() < 0.05:
        text += rng.choice((" ", "\r", " x", "\t\n", "{}"))
    if rng.random() < 0.03:  # a key twice: the last value counts, as for the JSON decoder
        text = text[:-1] + ', "worker": "w9"}'
    return text.encode("utf-8", "surrogatepass")


def _without_typed(lines: list[bytes], now: float | None) -> tuple[list[Any], list[Any]]:
    saved = records.TYPED_RECORD
    records.TYPED_RECORD = None
    try:
        return parse_lines(lines, now=now)
    finally:
        records.TYPED_RECORD = saved


def _key(rec: Any) -> tuple[str, frozenset[str]]:
    """Every value as written (repr: 1 and 1.0 differ) and the fields carried (a set: no order)."""
    return repr(replace(rec, carried=frozenset())), rec.carried


@pytest.mark.parametrize("conversion", ["default", "python"])
@pytest.mark.parametrize("seed", range(4))
def test_typed_lines_are_the_same_records_and_errors(seed: int, conversion: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both conversions of the decoded values: compiled (when built) and the Python one."""
    rng = random.Random(seed)
    if conversion == "python":
        monkeypatch.setattr(records, "TYPED_RECORD", records._compile_typed(records.SCHEMA, None))
    typed = records.TYPED_RECORD
    assert typed is not None
    lines = [_line(rng) for _ in range(3000)]
    taken = 0
    for line in lines:
        got = typed(line)
        if got is None:
            continue
        taken += 1
        want, errors = _without_typed([line], None)
        assert not errors and len(want) == 1, line
        assert _key(got) == _key(want[0]), line
    assert taken > 500
    now = GOOD["ts"] + rng.choice((0.0, 1000.0))  # some bodies' records are out of tolerance
    with_typed, errs_typed = parse_lines(lines, now=now)
    plain, errs_plain = _without_typed(lines, now)
    assert [_key(r) for r in with_typed] == [_key(r) for r in plain]
    assert errs_typed == errs_plain
    assert {e.kind for e in errs_plain} >= {"json", "schema", "value"}
