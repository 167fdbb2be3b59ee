"""The compiled family cache (``exporter.web._render_core``) against the Python reference and
prometheus_client: every value written byte for byte as ``floatToGoString`` writes it, and a
family's text, scrape after scrape, whatever changed in between, equal to the reference's."""

from __future__ import annotations

import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.utils import floatToGoString

from exporter.web.exposition import TEMPLATES, Renderer, format_value

core = pytest.importorskip("exporter.web._render_core", reason="the compiled renderer is not built")

EDGES = [0.0, -0.0, 1.0, -1.0, 0.1, 999999.0, 999999.9999999999, 1e6, -1e6, 1234567.0, 1234567.891, 24_000_000.0,
         1e15, 2.0 ** 53 - 1, 2.0 ** 53, 2.0 ** 53 + 2, 9999999999999998.0, 1e16, 1.5e16, 1e22, 1e-4, 1e-5, 1e-7,
         5e-324, 2.2250738585072014e-308, -2.2250738585072014e-308, 1.7976931348623157e308, -1.7976931348623157e308,
         math.inf, -math.inf, math.nan, -math.nan, struct.unpack("d", struct.pack("Q", 0x7FF8000000000001))[0]]

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2 ** 63), 2 ** 63).map(float),  # integers as floats, beyond 2**53 too
    st.integers(-10 ** 7, 10 ** 7).map(float),
    st.floats(min_value=1e5, max_value=1e17),  # around the switch to exponents
    st.floats(min_value=-1e-3, max_value=1e-3),  # tiny, subnormal
    st.sampled_from(EDGES),
)


@pytest.mark.parametrize("value", EDGES)
def test_edge_values_are_written_as_prometheus_client_writes_them(value: float) -> None:
    assert core.format_value(value) == floatToGoString(value) == format_value(value)


@settings(max_examples=3000, deadline=None)
@given(floats)
def test_any_value_is_written_as_prometheus_client_writes_it(value: float) -> None:
    assert core.format_value(value) == floatToGoString(value) == format_value(value)


def test_random_bit_patterns_are_written_as_prometheus_client_writes_them() -> None:
    import random

    rng = random.Random(5)
    for _ in range(50_000):
        value = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        assert core.format_value(value) == floatToGoString(value)


finite = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False).filter(bool),
    st.integers(1, 2 ** 52 - 1).map(lambda m: struct.unpack("d", struct.pack("Q", m))[0]),  # subnormals
    st.integers(-1074, 1023).map(lambda e: 2.0 ** e),
    st.integers(-323, 308).map(lambda e: 10.0 ** e),
)


@settings(max_examples=3000, deadline=None)
@given(finite)
def test_the_shortest_digits_are_those_of_repr(value: float) -> None:
    assert core.shortest_repr(value) == repr(value)
    assert core.shortest_repr(-value) == repr(-value)


def test_the_shortest_digits_of_random_bit_patterns_are_those_of_repr() -> None:
    import random

    rng = random.Random(17)
    for _ in range(100_000):
        value = struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0]
        if math.isfinite(value) and value:
            assert core.shortest_repr(value) == repr(value)


GAUGE = next(t for t in TEMPLATES if t.metric.name == "prefixscope_worker_resident_blocks")
WORKERS = ["w0", 'w"1\\', "wörker-β", "w\n3", "w4", "w5"]


def _expected(values: dict[tuple[str, ...], float]) -> bytes:
    return b"".join(f"{GAUGE.prefix(lv)}{floatToGoString(v)}\n".encode() for lv, v in sorted(values.items()))


# One scrape: a value per worker present (workers come and go between scrapes).
scrapes = st.lists(st.dictionaries(st.sampled_from(WORKERS), floats, max_size=len(WORKERS)), min_size=1, max_size=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scrapes, st.data())
def test_a_family_scrape_after_scrape_equals_the_reference(seq: list[dict[str, float]], data: st.DataObject) -> None:
    compiled, reference = Renderer(compiled=True), Renderer(compiled=False)
    previous: dict[tuple[str, ...], float] = {}
    for scrape in seq:
        values = {(w,): v for w, v in scrape.items()}
        if previous and data.draw(st.booleans(), label="keep the label sets, change some values"):
            values = {lv: data.draw(floats) if data.draw(st.booleans()) else v for lv, v in previous.items()}
        text = compiled._lines(GAUGE, values)
        assert text == reference._lines(GAUGE, values) == _expected(values)
        previous = values


def test_an_unchanged_family_reuses_its_text() -> None:
    renderer = Renderer(compiled=True)
    values = {(w,): float(i) for i, w in enumerate(WORKERS)}
    first = renderer._lines(GAUGE, values)
    assert renderer._lines(GAUGE, dict(values)) is first
    values[("w0",)] = -0.0  # the bits changed, not the value
    assert renderer._lines(GAUGE, values) == _expected(values) != first


def test_a_missing_label_set_builds_a_new_layout() -> None:
    layout = core.Layout((("a",), ("b",)), ["m{w=\"a\"} ", "m{w=\"b\"} "])
    assert core.lines(layout, {("a",): 1.0, ("c",): 2.0}) is None
    assert core.lines(layout, {("a",): 1.0}) is None
    assert core.lines(layout, {("a",): 1.0, ("b",): 2.5}).text == b'm{w="a"} 1.0\nm{w="b"} 2.5\n'


def test_a_value_that_is_not_a_number_is_refused() -> None:
    layout = core.Layout((("a",),), ["m "])
    with pytest.raises(TypeError):
        core.lines(layout, {("a",): "1"})


def test_values_are_read_whatever_the_order_of_the_dict() -> None:
    """A layout reads a dict in the order it was made for by walking it; another order of the
    same label sets (or equal label sets that are other objects) reads the same values."""
    keys = tuple(sorted((w,) for w in WORKERS))
    prefixes = [GAUGE.prefix(k) for k in keys]
    walked = {k: float(i) for i, k in enumerate(reversed(keys))}
    layout = core.Layout(keys, prefixes, tuple(walked))
    expected = _expected(walked)
    assert core.lines(layout, walked).text == expected
    assert core.lines(layout, dict(sorted(walked.items()))).text == expected
    assert core.lines(layout, {((w + "x")[:-1],): v for (w,), v in walked.items()}).text == expected
    moved = dict(walked)
    moved[keys[0]] = 9.5
    assert core.lines(layout, moved, core.lines(layout, walked)).text == _expected(moved)
    with pytest.raises(ValueError):
        core.Layout(keys, prefixes, (*keys[:-1], ("other",)))


HISTOGRAM = next(t for t in TEMPLATES if t.metric.name == "prefixscope_kv_block_eviction_age_seconds")
BUCKETS = len(HISTOGRAM.metric.buckets or ()) + 1  # and +Inf
counts = st.one_of(st.integers(0, 10**6).map(float), st.floats(0, 1e12), st.integers(0, 2**60))
rows = st.lists(counts, min_size=BUCKETS + 1, max_size=BUCKETS + 1)  # per-bucket counts, then the sum
histogram_scrapes = st.lists(st.dictionaries(st.tuples(st.sampled_from(WORKERS), st.sampled_from(("true", "false"))),
                                             rows, max_size=len(WORKERS)), min_size=1, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histogram_scrapes)
def test_a_histogram_family_scrape_after_scrape_equals_the_reference(seq: list[dict]) -> None:
    """Bucket lines (cumulative), ``_count`` and ``_sum`` per series, in sorted order, as the Python
    reference writes them; series that come and go between scrapes build a new layout."""
    compiled, reference = Renderer(compiled=True), Renderer(compiled=False)
    for scrape in seq:
        assert compiled._histogram(HISTOGRAM, scrape) == reference._histogram(HISTOGRAM, scrape)


def test_a_histogram_row_of_another_length_is_written_as_the_reference_writes_it() -> None:
    compiled, reference = Renderer(compiled=True), Renderer(compiled=False)
    good = {("w0", "true"): [1.0] * (BUCKETS + 1)}
    odd = {("w0", "true"): [1.0] * (BUCKETS + 1), ("w1", "false"): [2.0, 3.0]}
    for scrape in (good, odd, good):
        assert compiled._histogram(HISTOGRAM, scrape) == reference._histogram(HISTOGRAM, scrape)
    layout = core.HistogramLayout((("a",),), (core.SeriesPrefixes(["a "] * 2 + ["c ", "s "]),), 2)
    assert core.histogram_lines(layout, {("a",): [1.0, 2.0, 5.5]}) == b"a 1.0\na 3.0\nc 3.0\ns 5.5\n"
    assert core.histogram_lines(layout, {("b",): [1.0, 2.0, 5.5]}) is None
    assert core.histogram_lines(layout, {("a",): (1.0, 2.0, 5.5)}) is None  # not a list
    with pytest.raises(ValueError):
        core.HistogramLayout((("a",),), (core.SeriesPrefixes(["a ", "c ", "s "]),), 2)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(WORKERS), st.sampled_from(("true", "false"))), min_size=1, unique=True),
       st.data())
def test_histogram_series_added_a_few_at_a_time_are_placed_in_order(order: list, data: st.DataObject) -> None:
    """Series appearing scrape after scrape (eviction ages filling in worker by worker) are placed
    among the kept ones; the text is the reference's at every scrape."""
    compiled, reference = Renderer(compiled=True), Renderer(compiled=False)
    scrape: dict = {}
    for lv in order:
        scrape = {**scrape, lv: data.draw(rows)}
        if data.draw(st.booleans(), label="render now"):
            assert compiled._histogram(HISTOGRAM, scrape) == reference._histogram(HISTOGRAM, scrape)
    assert compiled._histogram(HISTOGRAM, scrape) == reference._histogram(HISTOGRAM, scrape)
