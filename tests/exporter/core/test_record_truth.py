"""Records that cannot be true are rejected at the HTTP intake, counted by kind, and move nothing.

Before: one record with a millisecond ``ts`` moved the exporter's input clock 50 years ahead, so
every record-based window was empty until a restart; ``1e400`` parsed to infinity and poisoned
every sum it entered.
"""

from __future__ import annotations

import json

import pytest
import requests

from exporter.config import Config, HttpRecords, parse_config
from exporter.core.checks import evaluate
from exporter.main import Runtime
from prefixscope.records import implausible_ts

NOW = 1_795_947_861.0


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _rec(i: int, **kw) -> dict:
    return {"ts": NOW - 1 + i * 0.01, "request_id": f"r{i}", "worker": "w0", "prompt_tokens": 1000,
            "cached_tokens": 800, "prefill_s": 0.02, "admitted_by_affinity": True, **kw}


def _post(runtime: Runtime, *objs: dict | str) -> requests.Response:
    body = "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objs).encode()
    return requests.post(runtime.url + "/api/v1/records", data=body, timeout=5)


def _errors(runtime: Runtime) -> dict[str, float]:
    counters = runtime.health.snapshot()[0].get("prefixscope_ingest_errors", {})
    return {kind: v for (source, kind), v in counters.items() if source == "records"}


@pytest.fixture
def runtime():
    rt = Runtime.build(Config(listen_address="127.0.0.1:0", http_records=HttpRecords(ts_tolerance_s=600.0)),
                       clock=Clock(NOW)).start()
    try:
        yield rt
    finally:
        rt.stop()


@pytest.mark.parametrize(("bad", "kind"), [
    ({"ts": NOW * 1000}, "timestamp"),  # milliseconds
    ({"ts": NOW + 3 * 3600}, "timestamp"),  # a clock hours ahead
    ({"ts": NOW - 86400}, "timestamp"),  # yesterday's file
    ({"ts": "1e400"}, "non_finite"),
    ({"prefill_s": "1e400"}, "non_finite"),
    ({"ttft_s": "-1e400"}, "non_finite"),
    ({"prefill_s": -0.5}, "schema"),  # a negative duration
])
def test_an_impossible_record_is_rejected_counted_and_moves_nothing(runtime: Runtime, bad: dict, kind: str) -> None:
    good = [_rec(i) for i in range(20)]
    assert _post(runtime, *good).status_code == 200
    before = evaluate(runtime.state)
    assert before.results["continuous_batching_affinity_admission_rate"].value == 1.0

    rec = _rec(99, **{k: v for k, v in bad.items() if not isinstance(v, str)})
    raw = {k: v for k, v in bad.items() if isinstance(v, str)}  # numbers JSON can spell, json.dumps cannot write
    line = json.dumps({k: v for k, v in rec.items() if k not in raw})
    if raw:
        line = line[:-1] + "".join(f', "{k}": {v}' for k, v in raw.items()) + "}"
    r = _post(runtime, line, _rec(100))
    assert r.status_code == 400, r.text  # a body with a bad line is a 400 that names it; its good lines are kept
    data = r.json()["data"]
    assert (data["accepted"], data["rejected"]) == (1, 1)
    assert data["errors"][0]["line"] == 1
    assert _errors(runtime) == {kind: 1.0}

    assert runtime.state.time.now == pytest.approx(NOW, abs=1)  # the exporter's clock did not move
    after = evaluate(runtime.state)
    for key in ("continuous_batching_affinity_admission_rate", "prefix_hit_rate_per_session"):
        assert after.results[key].value == before.results[key].value, key
    page = requests.get(runtime.url + "/metrics", timeout=5).text
    assert f'prefixscope_ingest_errors_total{{kind="{kind}",source="records"}} 1.0' in page
    assert not [x for x in page.splitlines() if x.endswith((" inf", " +Inf", " -Inf", " NaN"))]


def test_only_impossible_records_get_a_400_with_the_reason(runtime: Runtime) -> None:
    r = _post(runtime, _rec(0, ts=NOW * 1000))
    assert r.status_code == 400
    assert "milliseconds" in r.json()["data"]["errors"][0]["error"]


def test_the_tolerance_is_configurable_and_records_within_it_pass() -> None:
    cfg = parse_config({"records": {"ts_tolerance": "2h"}})
    assert cfg.http_records.ts_tolerance_s == cfg.file_records.ts_tolerance_s == 7200
    assert parse_config({}).http_records.ts_tolerance_s == 900
    assert implausible_ts(NOW - 7000, NOW, 7200) is None
    assert "behind" in (implausible_ts(NOW - 7300, NOW, 7200) or "")
    assert "ahead" in (implausible_ts(NOW + 7300, NOW, 7200) or "")
    assert "milliseconds" in (implausible_ts(NOW * 1000 + 5, NOW, 7200) or "")


def test_a_record_within_the_tolerance_does_not_move_the_exporters_clock(runtime: Runtime) -> None:
    assert _post(runtime, _rec(0, ts=NOW + 500)).status_code == 200  # a producer's clock 8 minutes fast
    assert runtime.state.time.now == NOW  # the windows still end at the exporter's own now
    assert evaluate(runtime.state).results["continuous_batching_affinity_admission_rate"].value == 1.0
