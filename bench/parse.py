"""Worker /metrics parsing: prefixscope's parser against prometheus_client's, on the same page.

The page is a simulated vLLM worker's /metrics (fleet.metrics_text renders vLLM's exact
exposition with prometheus_client: ~300 lines, histograms, ``_created`` series, spec decode).
Both parsers read the same text in the same run; the ratio is prometheus_client's time over ours.
Target: ≥ 10× faster for the scrape hot path (parse the names the normaliser reads).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporter.codecs import normalize, promtext

TARGET_RATIO = 10.0


def worker_page(flavour: str = "vllm") -> str:
    from fleet.clock import VirtualClock
    from fleet.engine import EngineRequest, SimEngine, WorkerSpec
    from fleet.metrics_text import render_metrics

    engine = SimEngine(WorkerSpec("w0", spec_tokens=3), VirtualClock())
    for i in range(200):  # enough traffic that every histogram has non-zero buckets
        start = (i % 7) * 4096
        engine.execute(EngineRequest(request_id=f"r{i}", token_ids=list(range(start, start + 200 + 13 * i)),
                                     max_tokens=8 + i % 50))
    engine.finish_all()
    return render_metrics(engine, flavour).decode()


def best_time(fn: Callable[[], Any], min_seconds: float = 0.3, repeats: int = 5) -> float:
    """Seconds per call: the best of ``repeats`` runs of as many calls as fill ``min_seconds``."""
    n = 1
    while True:
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= min_seconds / repeats:
            break
        n *= 2
    best = elapsed / n
    for _ in range(repeats - 1):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def run() -> Iterator[dict[str, Any]]:
    text = worker_page()
    lines = len(text.splitlines())
    baseline = best_time(lambda: list(text_string_to_metric_families(text)))
    wanted = best_time(lambda: promtext.parse(text, normalize.WORKER_NAMES))
    everything = best_time(lambda: promtext.parse(text))
    normalised = best_time(lambda: normalize.parse_worker("w0", text))
    rows = ((f"parse worker /metrics, wanted names ({lines} lines), µs", wanted, True),
            ("parse + normalise to WorkerSnapshot, µs", normalised, True),
            ("parse every sample (no name filter), µs", everything, False))
    for name, ours, gated in rows:
        ratio = baseline / ours
        yield {"name": name, "value": ours * 1e6, "baseline": baseline * 1e6, "ratio": ratio,
               "target": f"≥ {TARGET_RATIO:g}× prometheus_client" if gated else "-",
               "ok": ratio >= TARGET_RATIO if gated else True}

if __name__ == "__main__":
    for row in run():
        print(row)
