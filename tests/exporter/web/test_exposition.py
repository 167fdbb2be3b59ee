"""The direct text renderer: the same samples as the collector, escaping, promtool-clean."""

import math
import subprocess

import pytest
import requests
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, RouterSnapshot, WorkerSnapshot
from exporter.web.collector import PrefixscopeCollector
from exporter.web.exposition import escape_help, escape_label_value, format_value, render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.thresholds import load_thresholds
from prefixscope.topology import parse_topology
from tests.support import require_tool

# Label values that need escaping, and one that merely looks odd.
ODD = 'w"q\\uote\nline'
PLAIN = "wörker-β"

TOPOLOGY = parse_topology({
    "model": "m", "block_size": 16,
    "gpu_classes": {"H100": {"prefill_tps": 20000, "decode_tps": 100, "kv_blocks": 1000, "intra_node_gbps": 450,
                             "inter_node_gbps": 50, "price_per_gpu_hour": 3.6}},
    "workers": [
        {"name": ODD, "node": "n0", "nvlink_domain": "n0/d0", "gpu_class": "H100", "warm_pool": True},
        {"name": PLAIN, "node": "n1", "nvlink_domain": "n1/d0", "gpu_class": "H100"},
    ],
}, "test.yaml")


def busy_state() -> ClusterState:
    h = Health()
    st = ClusterState.build(h, load_thresholds(), topology=TOPOLOGY, clock=lambda: 200.0)
    h.set("prefixscope_up", (ODD, "worker"), 1)
    h.error("records", "schema", "bad line")
    st.apply_kv_batch(KvBatch(ODD, 0, 99.0, (BlockStored((1, 2, 3), None, 16), BlockStored((4,), 2, 16))), 100.0)
    st.apply_kv_batch(KvBatch(PLAIN, 0, 99.0, (BlockStored((1, 2, 5), None, 16),)), 100.0)
    for t, q in ((100, 1000), (110, 123456789)):
        st.observe_worker(WorkerSnapshot(ODD, "vllm", model='m"1', prefix_queried_tokens=q, prefix_hit_tokens=q / 3,
                                         kv_usage_ratio=0.25, num_gpu_blocks=1000, running=3, max_running=8), t)
    st.observe_router(RouterSnapshot("r\\1", "vllm-router", {ODD: 3}, {ODD: 1}, {"hit": 2}), 110)
    base = {"model": 'm"1', "block_hashes": [1, 2, 3, 9], "cached_tokens": 0, "prefill_s": 0.5,
            "walk_s": 0.001, "async_wait_s": 1.0, "segment": "seg\nx", "session_key": "s", "fallback_tier": "warm_pool"}
    st.ingest_records([
        {**base, "ts": 111, "request_id": "1", "worker": ODD, "prompt_tokens": 64},
        {**base, "ts": 112, "request_id": "2", "worker": PLAIN, "prompt_tokens": 64, "cached_tokens": 48,
         "migrated_from": ODD, "migration_kind": "soft"},
    ], 112)
    st.refresh_tree_stats()  # as the runtime's background refresher does
    return st


def collector_text(st: ClusterState) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st))
    return generate_latest(reg)


def samples(text: bytes) -> list[tuple]:
    return [(f.name, f.type, f.documentation, s.name, tuple(sorted(s.labels.items())), s.value)
            for f in text_string_to_metric_families(text.decode()) for s in f.samples]


def test_same_samples_as_the_collector_byte_for_byte():
    st = busy_state()
    ours, reference = render_state(st), collector_text(st)
    assert samples(ours) == samples(reference)
    assert ours == reference


def test_escaped_values_parse_back():
    text = render_state(busy_state())
    parsed = {(s.name, tuple(sorted(s.labels.items()))): s.value
              for f in text_string_to_metric_families(text.decode()) for s in f.samples}
    assert parsed[("prefixscope_worker_resident_blocks", (("worker", ODD),))] == 4.0
    assert parsed[("prefixscope_worker_resident_blocks", (("worker", PLAIN),))] == 3.0
    assert parsed[("prefixscope_router_decisions_total", (("router", "r\\1"), ("worker", ODD)))] == 3.0


def test_escaping_and_number_formatting():
    assert escape_label_value('a"b\\c\nd') == 'a\\"b\\\\c\\nd'
    assert escape_label_value("plain") == "plain"
    assert escape_help("x\\y\nz") == "x\\\\y\\nz"
    assert [format_value(v) for v in (0, 0.5, 3, 1e6, 12345678.0, 1e-5, -2.5e7, math.inf, -math.inf)] == [
        "0.0", "0.5", "3.0", "1e+06", "1.2345678e+07", "1e-05", "-25000000.0", "+Inf", "-Inf"]
    assert format_value(math.nan) == "NaN"


def test_empty_state_renders_only_what_has_a_source():
    st = ClusterState.build(Health(), load_thresholds())
    text = render_state(st)
    assert text == collector_text(st)
    assert b'prefixscope_signal_available{signal="kv_events"} 0.0' in text
    assert b"prefixscope_worker_resident_blocks" not in text


@pytest.mark.slow
def test_promtool_check_metrics_is_clean():
    out = subprocess.run([require_tool("promtool"), "check", "metrics"], input=render_state(busy_state()),
                         capture_output=True, timeout=60)
    assert out.returncode == 0, out.stdout.decode() + out.stderr.decode()
    assert out.stdout.decode().strip() == "" and out.stderr.decode().strip() == ""


def test_server_serves_the_direct_text_and_openmetrics_from_the_registry():
    st = busy_state()
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st))
    srv = ExporterServer("127.0.0.1", 0, ServerDeps(registry=reg, api={}, render_text=lambda: render_state(st))).start()
    try:
        text = requests.get(srv.url + "/metrics", timeout=5)
        assert text.status_code == 200 and text.headers["Content-Type"].startswith("text/plain")
        assert text.content == collector_text(st)
        om = requests.get(srv.url + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"},
                          timeout=5)
        assert om.headers["Content-Type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n") and "prefixscope_worker_resident_blocks" in om.text
    finally:
        srv.stop()


def test_a_scrape_runs_with_automatic_collection_paused_and_restores_it():
    # A scrape's objects all die with it: collections meanwhile would only promote them (and
    # walk the whole heap every few scrapes), so the scrape pauses them and restores the setting.
    import gc

    from exporter.web.exposition import CollectorPause

    st = busy_state()
    seen: list[bool] = []
    st.series = lambda real=st.series: (seen.append(gc.isenabled()), real())[1]  # type: ignore[method-assign]
    assert gc.isenabled()
    render_state(st)
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a process that turned collection off keeps it off
    try:
        render_state(st)
        assert not gc.isenabled()
    finally:
        gc.enable()
    pause = CollectorPause(max_s=0.0)
    with pause:  # overlapping scrapes share one pause, which is not extended past max_s
        assert not gc.isenabled()
        with pause:
            assert gc.isenabled()
        assert gc.isenabled()
    assert gc.isenabled()
