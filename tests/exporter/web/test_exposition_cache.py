"""The cached renderer across scrapes: whatever changed between two scrapes (values, label
sets, signed zeros, NaN, large values), each scrape's text is the reference collector's, from
the compiled family cache (where it is built) and from the Python reference alike."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from exporter.core.series_view import Series
from exporter.web.collector import families
from exporter.web.exposition import CORE, Renderer
from tests.exporter.web.test_exposition import ODD, busy_state

RESIDENT = "prefixscope_worker_resident_blocks"
QUERIED = "prefixscope_prefix_cache_queried_tokens"


class _Fixed(Collector):
    def __init__(self, series: Series) -> None:
        self.series = series

    def collect(self) -> Iterator[Metric]:
        return families(self.series)


def reference(series: Series) -> bytes:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_Fixed(series))
    return generate_latest(reg)


@pytest.fixture(scope="module")
def base() -> Series:
    st = busy_state()
    return st.snapshot_for(lambda s: s.series())


MODES = [False, *([True] if CORE == "compiled" else [])]  # Renderer(compiled=...): reference, compiled


@pytest.fixture(params=MODES, ids=lambda c: "compiled" if c else "reference")
def make_renderer(request: pytest.FixtureRequest) -> Callable[[], Renderer]:
    return lambda: Renderer(compiled=request.param)


def _edit(fn: Callable[[Series], None]) -> Callable[[Series], Series]:
    def step(s: Series) -> Series:
        s = copy.deepcopy(s)
        fn(s)
        return s
    return step


def _set(metric: str, value: float, kind: str = "gauges", labels: tuple[str, ...] | None = None):
    def fn(s: Series) -> None:
        fam = getattr(s, kind)[metric]
        fam[labels if labels is not None else next(iter(fam))] = value
    return fn


def _add_worker(s: Series) -> None:
    s.gauges[RESIDENT][("w-new",)] = 7.0


def _swap_worker(s: Series) -> None:  # the same number of series, one label set replaced
    fam = s.gauges[RESIDENT]
    fam.pop(next(iter(fam)))
    fam[('a "quoted"\\name',)] = 3.0


def _drop_all(s: Series) -> None:
    s.gauges[RESIDENT] = {}


def _every_value(s: Series) -> None:
    for fams in (s.counters, s.gauges):
        for fam in fams.values():
            for lv in fam:
                fam[lv] = fam[lv] * 3 + 1


STEPS = [
    ("unchanged", _edit(lambda s: None)),
    ("one value", _edit(_set(RESIDENT, 5.0, labels=(ODD,)))),
    ("zero", _edit(_set(RESIDENT, 0.0, labels=(ODD,)))),
    ("negative zero", _edit(_set(RESIDENT, -0.0, labels=(ODD,)))),
    ("zero again", _edit(_set(RESIDENT, 0.0, labels=(ODD,)))),
    ("NaN", _edit(_set(RESIDENT, math.nan, labels=(ODD,)))),
    ("a large value", _edit(_set(RESIDENT, 123456789.0, labels=(ODD,)))),
    ("infinities", _edit(_set(RESIDENT, -math.inf, labels=(ODD,)))),
    ("an int", _edit(_set(RESIDENT, 12, labels=(ODD,)))),
    ("a counter", _edit(_set(QUERIED, 1e22, kind="counters"))),
    ("a label set added", _edit(_add_worker)),
    ("a label set replaced", _edit(_swap_worker)),
    ("every value", _edit(_every_value)),
    ("a family emptied", _edit(_drop_all)),
    ("a family back", _edit(_add_worker)),
]


def test_every_scrape_matches_the_reference(base: Series, make_renderer: Callable[[], Renderer]) -> None:
    renderer = make_renderer()
    series = base
    assert renderer.render(series) == reference(series)
    for what, step in STEPS:
        series = step(series)
        assert renderer.render(series) == reference(series), what


def test_two_renderers_alternating_states_stay_exact(base: Series, make_renderer: Callable[[], Renderer]) -> None:
    """One renderer fed two unrelated series in turn (as two exporters in one process would)."""
    other = _edit(_every_value)(base)
    renderer = make_renderer()
    for series in (base, other, base, other, base):
        assert renderer.render(series) == reference(series)


@pytest.mark.parametrize("value", [0.0, -0.0, 1.5, 999999.9999999999, 1e6, 1234567.0, 1e16, 1e-7, -1e9,
                                   math.inf, -math.inf, math.nan, 5e-324])
def test_values_written_as_the_reference_writes_them(base: Series, value: float,
                                                     make_renderer: Callable[[], Renderer]) -> None:
    series = _edit(_set(RESIDENT, value, labels=(ODD,)))(base)
    text = make_renderer().render(series)
    assert text == reference(series)


def test_only_changed_values_are_formatted(base: Series, monkeypatch: pytest.MonkeyPatch) -> None:
    """Of counter and gauge families, a scrape formats the values that changed since the last one
    (the Python reference; the compiled cache does the same in C, where it cannot be counted)."""
    import exporter.web.exposition as exposition

    formatted: list[float] = []
    real = exposition.format_value

    def counting(v: float) -> str:
        formatted.append(v)
        return real(v)

    renderer = Renderer(compiled=False)
    renderer.render(base)
    monkeypatch.setattr(exposition, "format_value", counting)
    monkeypatch.setattr(exposition, "_value_texts", lambda values: pytest.fail("a whole family formatted"))
    again = copy.deepcopy(base)
    assert renderer.render(again) == reference(again)
    histogram_values = len(formatted)  # histograms are formatted on every scrape (few series)
    formatted.clear()
    changed = _edit(_set(RESIDENT, 99.0, labels=(ODD,)))(again)
    assert renderer.render(changed) == reference(changed)
    assert len(formatted) == histogram_values + 1 and 99.0 in formatted


def test_without_the_compiled_core_the_reference_renders_and_says_so() -> None:
    """An install without a C compiler renders /metrics with the Python reference (logged once)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[3]
    code = ("import sys; sys.modules['exporter.web._render_core'] = None\n"
            "from exporter.web import exposition as e\n"
            "from tests.exporter.web.test_exposition import busy_state\n"
            "st = busy_state()\n"
            "text = e.render_state(st); again = e.render_state(st)\n"
            "print(e.CORE, text == again and len(text) > 0)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo,
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["reference", "True"], out.stderr
    assert out.stderr.count("/metrics renderer: the Python reference") == 1
