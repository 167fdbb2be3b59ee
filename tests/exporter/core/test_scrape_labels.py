"""A worker's scraped series follow what its /metrics page still reports: a label value the page
stopped carrying (a model it no longer serves, a cache tier it no longer counts) has its series
dropped after ``limits.label_idle``; the values it still reports, and a worker that is merely
not scraped, keep theirs."""

from __future__ import annotations

from exporter.codecs.normalize import parse_worker
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import Limits
from exporter.web.exposition import render_state
from prefixscope.thresholds import load_thresholds

IDLE = 900.0


def page(model: str, queries: float, sources: tuple[str, ...]) -> str:
    """A vLLM page serving ``model``, its prompt tokens cached by each of ``sources``."""
    cached = "".join(f'vllm:prompt_tokens_cached_by_source_total{{engine="0",model_name="{model}",'
                     f'source="{s}"}} {queries / 4}\n' for s in sources)
    return f"""# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{{engine="0",model_name="{model}"}} {queries}
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{{engine="0",model_name="{model}"}} {queries / 2}
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{{block_size="16",engine="0",num_gpu_blocks="1000"}} 1.0
# TYPE vllm:prompt_tokens_cached_by_source_total counter
{cached}"""


def scrape(st: ClusterState, worker: str, text: str, ts: float) -> None:
    snapshot, errors = parse_worker(worker, text)
    assert errors == []
    st.observe_worker(snapshot, ts)


def lines(st: ClusterState, needle: str) -> list[str]:
    return [ln for ln in render_state(st).decode().splitlines() if needle in ln and not ln.startswith("#")]


def test_series_of_label_values_a_worker_stopped_reporting_are_dropped_after_label_idle() -> None:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300, limits=Limits(label_idle=IDLE))
    for ts in (0.0, 60.0):
        scrape(st, "w0", page("old-model", 100.0 + ts, ("local_compute", "local_cache_hit", "external_kv_transfer")), ts)
        scrape(st, "w1", page("old-model", 100.0 + ts, ("local_cache_hit",)), ts)
    assert lines(st, 'model="old-model"')
    # w0 is redeployed with another model and no longer counts the external tier; w1 is not
    # scraped at all (down or unreachable): that is missing signal, not a value it dropped
    for ts in range(120, 60 + int(IDLE), 60):
        scrape(st, "w0", page("new-model", float(ts), ("local_compute", "local_cache_hit")), float(ts))
    assert any('worker="w0"' in ln for ln in lines(st, 'model="old-model"'))  # not idle long enough yet
    scrape(st, "w0", page("new-model", 60.0 + IDLE, ("local_compute", "local_cache_hit")), 60.0 + IDLE)
    scrape(st, "w0", page("new-model", 120.0 + IDLE, ("local_compute", "local_cache_hit")), 120.0 + IDLE)
    assert not any('worker="w0"' in ln for ln in lines(st, 'model="old-model"'))
    assert lines(st, 'tier="external_kv_transfer"') == []
    new = lines(st, 'model="new-model"')
    assert any("prefixscope_prefix_cache_queried_tokens_total" in ln for ln in new)
    assert any('tier="local_cache_hit"' in ln for ln in new)
    # w1's series stay: it reported nothing else since
    assert any('worker="w1"' in ln for ln in lines(st, 'model="old-model"'))
