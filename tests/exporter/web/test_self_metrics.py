"""What the exporter says it costs itself: process_* and python_gc_* series, CPU and wall time per duty."""

from __future__ import annotations

import subprocess
from pathlib import Path

import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.process_collector import ProcessCollector

from exporter.loops.duty_clock import DUTIES, DutyClock
from exporter.web.process_metrics import SelfMetrics
from prefixscope import catalog
from tests.exporter.codecs.test_otlp import TRACE, VLLM_ATTRS, _json_request
from tests.exporter.test_export_fleet import TOKEN, prompt, running_cluster, settle
from tests.support import require_tool, wait_for

PROCESS = ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
           "process_open_fds", "process_max_fds", "process_start_time_seconds")
DUTY_CPU = "prefixscope_exporter_duty_cpu_seconds_total"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def duty_cpu(values: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {labels[0][1]: v for (name, labels), v in values.items() if name == DUTY_CPU}


# ---- the duty clock on its own ----------------------------------------------------------------
class FakeClocks:
    def __init__(self) -> None:
        self.cpu = 0.0
        self.wall = 0.0

    def thread_time(self) -> float:
        return self.cpu

    def wall_time(self) -> float:
        return self.wall


def test_a_timed_block_adds_its_cpu_and_wall_time_to_its_duty_only() -> None:
    t = FakeClocks()
    clock = DutyClock(t.thread_time, t.wall_time, buckets=(0.01, 0.1, 1.0))
    with clock.duty("scrape"):
        t.cpu += 0.02
        t.wall += 0.1  # on a bound: counted in that bucket (le)
    with clock.duty("scrape"):
        t.cpu += 0.5
        t.wall += 2.0
    totals = clock.totals()
    assert totals.cpu["scrape"] == 0.52
    assert totals.wall["scrape"] == [0.0, 1.0, 0.0, 1.0, 2.1]
    assert all(totals.cpu[d] == 0.0 and totals.wall[d] == [0.0] * 5 for d in DUTIES if d != "scrape")


def test_a_failing_batch_is_still_charged_and_wrap_times_each_call() -> None:
    t = FakeClocks()
    clock = DutyClock(t.thread_time, t.wall_time)

    def step() -> str:
        t.cpu += 0.25
        return "done"

    assert clock.wrap("breach", step)() == "done"
    try:
        with clock.duty("render"):
            t.cpu += 0.5
            raise ValueError("render bug")
    except ValueError:
        pass
    assert clock.totals().cpu["breach"] == 0.25 and clock.totals().cpu["render"] == 0.5


def test_the_duties_are_the_catalogues() -> None:
    assert DUTIES == catalog.DUTY_NAMES
    m = catalog.METRICS_BY_NAME["prefixscope_exporter_duty_cpu_seconds"]
    assert (m.type, m.unit, m.labels, m.sample_name) == ("counter", "seconds", ("duty",), DUTY_CPU)


# ---- the rendered families ---------------------------------------------------------------------
def test_process_series_are_prometheus_clients_and_promtool_clean() -> None:
    promtool = require_tool("promtool")
    text = SelfMetrics(DutyClock()).render_text().decode()
    reg = CollectorRegistry()
    ProcessCollector(registry=reg)
    reference = text_string_to_metric_families(generate_latest(reg).decode())
    ours = {f.name: f for f in text_string_to_metric_families(text)}
    for fam in reference:  # same names, types and help; the values of the same process
        assert (ours[fam.name].type, ours[fam.name].documentation) == (fam.type, fam.documentation)
    got = samples(text)
    assert {name for name, _ in got} >= {*PROCESS, "python_gc_collections_total", DUTY_CPU}
    assert set(duty_cpu(got)) == set(DUTIES)
    r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stdout + r.stderr


def test_without_proc_the_process_series_are_missing_not_zero(tmp_path: Path) -> None:
    got = samples(SelfMetrics(DutyClock(), proc=str(tmp_path)).render_text().decode())
    assert not any(name.startswith("process_") for name, _ in got)
    assert set(duty_cpu(got)) == set(DUTIES)


# ---- a runtime against real sources of each kind ----------------------------------------------
def test_every_duty_is_charged_and_their_sum_stays_within_the_process_cpu() -> None:
    with running_cluster(scrape=True) as c:  # fleet workers: HTTP scrapes, ZMQ KV events, record POSTs
        for i in range(4):
            c.ask(f"w{i % 2}", prompt(f"d{i}", 4), session=f"s{i % 2}")
        settle(c)
        body = _json_request([{"trace": TRACE, "attrs": VLLM_ATTRS}], {"service.name": "w0"})
        r = requests.post(c.url + "/v1/traces", data=body, timeout=5,
                          headers={"Content-Type": "application/json", "Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200

        def charged() -> dict[str, float] | None:
            got = samples(requests.get(c.url + "/metrics", timeout=5).text)
            cpu = duty_cpu(got)
            return got if all(cpu.get(d, 0.0) > 0.0 for d in DUTIES) else None

        got = wait_for(charged, what="every duty charged")
        assert sum(duty_cpu(got).values()) <= got[("process_cpu_seconds_total", ())]
        for duty in DUTIES:  # each duty ran at least one timed batch
            assert got[("prefixscope_exporter_duty_seconds_count", (("duty", duty),))] >= 1.0, duty
        openmetrics = requests.get(c.url + "/metrics", headers={"Accept": "application/openmetrics-text"},
                                   timeout=5).text
        assert 'prefixscope_exporter_duty_cpu_seconds_total{duty="kv_ingest"}' in openmetrics
        assert "process_cpu_seconds_total" in openmetrics
