"""Worker /metrics parsing: prefixscope's parser against prometheus_client's, on the same page.

The page is a simulated vLLM worker's /metrics (fleet.metrics_text renders vLLM's exact
exposition with prometheus_client: ~300 lines, histograms, ``_created`` series, spec decode).
Both parsers read the same text in the same run; the ratio is prometheus_client's time over ours.
Target: ≥ 10× faster for the scrape hot path (parse the names the normaliser reads).

Every sample: ``promtext.parse`` with no name filter, in samples per second of CPU, against the
Python reference (``parse_reference``) in the same run. The scanner reads a scraper's pages with
a series cache, so the row is a page's next scrape: two pages of the same worker, with the same
series and different values, read in turn with one cache (the first scrape, which parses each
label block, is the row after it). Target: ≥ 2.4 M samples/s, what Prometheus's Go parser reads.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from exporter.codecs import normalize, promtext

TARGET_RATIO = 10.0
TARGET_SAMPLES_S = 2.4e6


def worker_page(flavour: str = "vllm", requests: int = 200) -> str:
    from fleet.clock import VirtualClock
    from fleet.engine import EngineRequest, SimEngine, WorkerSpec
    from fleet.metrics_text import render_metrics

    engine = SimEngine(WorkerSpec("w0", spec_tokens=3), VirtualClock())
    for i in range(requests):  # enough traffic that every histogram has non-zero buckets
        start = (i % 7) * 4096
        engine.execute(EngineRequest(request_id=f"r{i}", token_ids=list(range(start, start + 200 + 13 * i)),
                                     max_tokens=8 + i % 50))
    engine.finish_all()
    return render_metrics(engine, flavour).decode()


def best_time(fn: Callable[[], Any], min_seconds: float = 0.3, repeats: int = 5,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds per call: the best of ``repeats`` runs of as many calls as fill ``min_seconds``."""
    n = 1
    while True:
        t0 = clock()
        for _ in range(n):
            fn()
        elapsed = clock() - t0
        if elapsed >= min_seconds / repeats:
            break
        n *= 2
    best = elapsed / n
    for _ in range(repeats - 1):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n)
    return best


def _every_sample_rows() -> Iterator[dict[str, Any]]:
    pages = [worker_page(), worker_page(requests=260)]
    counts = {sum(len(v) for v in promtext.parse_reference(p).samples.values()) for p in pages}
    if len(counts) != 1 or promtext.parse(pages[0], cache=promtext.SeriesCache()) != promtext.parse_reference(pages[0]):
        raise RuntimeError("the two pages differ in series, or the scanner differs from the reference")
    samples = counts.pop()
    cpu = time.process_time
    reference = best_time(lambda: [promtext.parse_reference(p) for p in pages], clock=cpu, repeats=7) / 2
    cache = promtext.SeriesCache()
    warm = best_time(lambda: [promtext.parse(p, cache=cache) for p in pages], clock=cpu, repeats=7) / 2
    cold = best_time(lambda: [promtext.parse(p, cache=promtext.SeriesCache()) for p in pages], clock=cpu, repeats=7) / 2
    core = promtext.CORE
    yield {"name": f"samples/s, all samples ({samples} a page; {core} scanner, the series cache warm: "
                   "the page's next scrape, new values), M/s of CPU",
           "value": samples / warm / 1e6, "baseline": samples / reference / 1e6, "ratio": reference / warm,
           "target": f"≥ {TARGET_SAMPLES_S / 1e6:g} M/s (Prometheus's Go parser)",
           "ok": samples / warm >= TARGET_SAMPLES_S}
    yield {"name": "samples/s, all samples, first scrape (every label block parsed), M/s of CPU",
           "value": samples / cold / 1e6, "baseline": samples / reference / 1e6, "ratio": reference / cold,
           "target": "-", "ok": True}


def run() -> Iterator[dict[str, Any]]:
    text = worker_page()
    lines = len(text.splitlines())
    baseline = best_time(lambda: list(text_string_to_metric_families(text)))
    cache = promtext.SeriesCache()  # as the scraper reads its pages: label sets parsed once
    wanted = best_time(lambda: promtext.parse(text, normalize.WORKER_NAMES, cache=cache))
    normalised = best_time(lambda: normalize.parse_worker("w0", text, cache=cache))
    rows = ((f"parse worker /metrics, wanted names ({lines} lines), µs", wanted, True),
            ("parse + normalise to WorkerSnapshot, µs", normalised, True))
    for name, ours, gated in rows:
        ratio = baseline / ours
        yield {"name": name, "value": ours * 1e6, "baseline": baseline * 1e6, "ratio": ratio,
               "target": f"≥ {TARGET_RATIO:g}× prometheus_client" if gated else "-",
               "ok": ratio >= TARGET_RATIO if gated else True}
    yield from _every_sample_rows()

if __name__ == "__main__":
    for row in run():
        print(row)
