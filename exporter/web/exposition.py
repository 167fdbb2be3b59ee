"""The Prometheus text format (0.0.4) rendered straight from ``Series``, without metric objects.

A 1,000-worker fleet has tens of thousands of samples; building one prometheus_client
``Sample`` per value and formatting it through ``generate_latest`` costs more than the
state's own work. This renderer writes the same bytes ``generate_latest`` writes for the
collector's families (same family order, same sorted label names, same value formatting,
``_total`` counters, histograms as ``_bucket``/``_count``/``_sum``, gauge histograms as
``_bucket`` plus the ``_gcount``/``_gsum`` gauges) from precomputed per-metric templates.
``exporter.web.collector`` stays the reference (and serves OpenMetrics); tests compare the two.

What a scrape costs. A counter or gauge family's lines are cached between scrapes
(``Renderer``): its label sets in sorted order, each one's ``name{labels} `` prefix already
escaped, the values as raw 8-byte doubles and as written, and the family's text. A scrape reads
the family's values in the cached order (one C-level ``itemgetter`` call; a missing label set,
or a different count, means the label sets changed: prefixes are rebuilt and sorted once),
packs them into a double array and compares its bytes with the last scrape's — exact, so
``-0.0`` against ``0.0`` or a NaN counts as a change. An unchanged family reuses its text; in a
changed one only the values whose bytes differ are formatted again, and the lines are joined.
So a scrape costs a few C-level operations per sample, plus formatting per changed value, plus
a sort and escaping per family whose label sets changed. Histograms change at most scrapes
(every worker's eviction ages): their lines are written every time, straight into the text, from
bucket, ``_count`` and ``_sum`` prefixes kept per series (in C, one pass that sums the bucket counts
and formats each). Series come in a few at a time (a worker's first eviction of reused blocks): a
new one gets its prefixes and a place in the kept order by bisection, the others are not touched.
Nothing depends on history or age: the cache holds one entry per family, replaced
whole (threads rendering at once each see a complete entry), sized by the number of series,
which the exporter's cardinality limits bound. What the series themselves cost to gather is
``exporter.core.series_view``'s (hot branches: ``exporter.core.hotspots``).

The per-family cache runs compiled (``exporter.web._render_core``: reading, comparing, formatting
and joining a family's values in one C pass, which is what a live scrape, where most per-worker
values moved, costs) when the extension is built, else in Python; :data:`CORE` says which. The
Python one (``Renderer(compiled=False)``, ``format_value``) is the reference the tests compare the
compiled one with, byte for byte.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
from array import array
from bisect import insort
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import compress
from operator import add, itemgetter, ne

from exporter.core.state import ClusterState, Series
from exporter.core.windows import LabelValues, bucket_counts
from exporter.web.collector import ALWAYS, _le
from prefixscope import catalog

try:
    from exporter.web import _render_core
except ImportError as exc:  # not built: the Python reference renders
    _render_core = None  # type: ignore[assignment]
    logging.getLogger(__name__).warning("/metrics renderer: the Python reference (compiled core not used: %s)", exc)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
CORE = "reference" if _render_core is None else "compiled"
_INF = math.inf


def escape_help(text: str) -> str:
    """HELP text escaping of the text format: backslash and newline."""
    return text.replace("\\", r"\\").replace("\n", r"\n")


def escape_label_value(value: str) -> str:
    """Label value escaping of the text format: backslash, newline and double quote."""
    if "\\" in value or "\n" in value or '"' in value:
        return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
    return value


def format_value(v: float) -> str:
    """A sample value exactly as prometheus_client writes it (Go-style exponents, +Inf, NaN)."""
    d = float(v)
    if d == _INF:
        return "+Inf"
    if d == -_INF:
        return "-Inf"
    if d != d:
        return "NaN"
    s = repr(d)
    dot = s.find(".")
    if d > 0 and dot > 6:  # Go switches to exponent notation sooner than Python
        mantissa = f"{s[0]}.{s[1:dot]}{s[dot + 1:]}".rstrip("0.")
        return f"{mantissa}e+{dot - 1:02d}"
    return s


@dataclass(frozen=True)
class _Template:
    """How one family's sample lines are built: label names sorted as prometheus_client sorts them."""

    metric: catalog.Metric
    header: str
    order: tuple[int, ...]  # indexes into the label values, in sorted label-name order
    names: tuple[str, ...]  # the label names in that order
    le_at: int  # position of ``le`` among the sorted names of a bucket sample (-1: none)
    line: str  # ``name{a="%s",b="%s"} %s\n``: one %-format for a whole sample line

    def ordered(self, values: tuple[str, ...]) -> list[str]:
        return [escape_label_value(values[i]) for i in self.order]

    def prefix(self, values: tuple[str, ...]) -> str:
        """``name{labels} ``: a sample line up to its value."""
        if not self.order:
            return f"{self.metric.sample_name} "
        return f"{self.line[:-4] % tuple(self.ordered(values))} "  # the line's format without " %s\n"

    def labels(self, values: tuple[str, ...]) -> str:
        if not self.order:
            return ""
        return "{" + ",".join(f'{n}="{v}"' for n, v in zip(self.names, self.ordered(values), strict=True)) + "}"

    def bucket_labels(self, values: tuple[str, ...]) -> Callable[[str], str]:
        """``le`` → the label block of one bucket sample (the rest formatted once)."""
        parts = [f'{n}="{v}"' for n, v in zip(self.names, self.ordered(values), strict=True)]
        head = ",".join(parts[: self.le_at])
        tail = ",".join(parts[self.le_at:])
        head = "{" + head + "," if head else "{"
        tail = "," + tail + "}" if tail else "}"
        return lambda le: f'{head}le="{le}"{tail}'


def _header(name: str, help_: str, type_: str) -> str:
    return f"# HELP {name} {escape_help(help_)}\n# TYPE {name} {type_}\n"


def _template(m: catalog.Metric) -> _Template:
    sample_type = {"counter": "counter", "gauge": "gauge", "info": "gauge"}.get(m.type, "histogram")
    names = sorted(range(len(m.labels)), key=lambda i: m.labels[i])
    sorted_names = tuple(m.labels[i] for i in names)
    le_at = sum(1 for n in sorted_names if n < "le") if m.buckets is not None else -1
    block = "{" + ",".join(f'{n}="%s"' for n in sorted_names) + "}" if sorted_names else ""
    line = f"{m.sample_name}{block} %s\n"
    return _Template(m, _header(m.sample_name, m.help, sample_type), tuple(names), sorted_names, le_at, line)


TEMPLATES: tuple[_Template, ...] = tuple(_template(m) for m in catalog.METRICS)
_HEADERS: tuple[bytes, ...] = tuple(t.header.encode("utf-8") for t in TEMPLATES)
_BOUNDS: dict[str, tuple[str, ...]] = {
    m.name: (*(_le(b) for b in m.buckets), "+Inf") for m in catalog.METRICS if m.buckets is not None}


def _histogram_lines(out: list[str], name: str, bounds: tuple[str, ...], labels: Callable[[str], str],
                     plain: str, counts: Iterable[float], total: float, count_suffix: str, sum_suffix: str,
                     tail: list[str] | None = None) -> None:
    cum = 0.0
    bucket = f"{name}_bucket"
    for le, c in zip(bounds, counts, strict=False):
        cum += c
        out.append(f"{bucket}{labels(le)} {format_value(cum)}\n")
    dest = out if tail is None else tail
    dest.append(f"{name}{count_suffix}{plain} {format_value(cum)}\n")
    dest.append(f"{name}{sum_suffix}{plain} {format_value(total)}\n")


def _value_texts(values: list[float]) -> list[str]:
    """Each value as ``format_value`` writes it."""
    text = list(map(repr, values))  # what format_value returns for finite values below 1e6
    for i, v in enumerate(values):
        if not -_INF < v < 1e6:  # Go-style exponents, +Inf, -Inf, NaN
            text[i] = format_value(v)
    return text


def _changed_texts(old: list[str], old_raw: bytes, raw: bytes, values: list[float]) -> list[str]:
    """``old`` with the values whose 8 bytes differ from the last scrape's formatted anew."""
    changed = list(compress(range(len(values)), map(ne, array("Q", raw), array("Q", old_raw))))
    if 2 * len(changed) > len(values):
        return _value_texts(values)
    text = old.copy()
    for i in changed:
        text[i] = format_value(values[i])
    return text


def _joined(prefixes: list[str], texts: list[str]) -> bytes:
    """Sample lines (UTF-8): each prefix followed by its value."""
    return ("\n".join(map(add, prefixes, texts)) + "\n").encode("utf-8") if prefixes else b""


@dataclass(frozen=True)
class _Family:
    """One family's lines at one scrape: enough to tell whether the next scrape's values differ,
    and which."""

    keys: tuple[LabelValues, ...]  # label values, sorted as the reference sorts them
    get: Callable[[dict[LabelValues, float]], tuple[float, ...]]  # the values in that order
    prefixes: list[str]  # ``name{labels} `` of each
    raw: bytes  # the values as native doubles
    texts: list[str]  # the values as written
    text: bytes  # the lines


def _getter(keys: tuple[LabelValues, ...]) -> Callable[[dict[LabelValues, float]], tuple[float, ...]]:
    if len(keys) == 1:
        only = keys[0]
        return lambda d: (d[only],)
    if not keys:
        return lambda d: ()
    return itemgetter(*keys)


class Renderer:
    """The text exposition with each counter and gauge family cached between scrapes (see the
    module docstring for what a scrape costs)."""

    def __init__(self, compiled: bool | None = None) -> None:
        """``compiled`` None: the compiled family cache where it is built; False: the Python reference."""
        if compiled and _render_core is None:
            raise RuntimeError("exporter.web._render_core is not built")
        self._families: dict[str, _Family] = {}
        self._compiled: dict[str, _render_core.Lines] = {}
        self._histogram_layouts: dict[str, _render_core.HistogramLayout] = {}
        # Each compiled family's sample prefixes by label set, as of its last layout: a family
        # whose label sets change (a worker's series appearing) writes the new ones' prefixes
        # only, and drops those of label sets gone (it holds its current series, no more).
        self._prefixes: dict[str, dict[LabelValues, bytes]] = {}  # UTF-8, as the layouts hold them
        self._histogram_series: dict[str, dict[LabelValues, _render_core.SeriesPrefixes]] = {}
        use = _render_core is not None and compiled is not False
        self._lines = self._compiled_lines if use else self._reference_lines
        self._histogram = self._compiled_histogram if use else self._reference_histogram

    def _compiled_lines(self, t: _Template, values: dict[LabelValues, float]) -> bytes:
        name = t.metric.sample_name
        if type(values) is not dict:
            values = dict(values)
        last = self._compiled.get(name)
        lines = None if last is None else _render_core.lines(last.layout, values, last)
        if lines is None:  # first scrape of the family, or its label sets changed
            keys = tuple(sorted(values))
            known = self._prefixes.get(name, {})
            made = {lv: known.get(lv) or t.prefix(lv).encode("utf-8") for lv in keys}
            self._prefixes[name] = made
            layout = _render_core.Layout(keys, list(made.values()), tuple(values))
            lines = _render_core.lines(layout, values)
        if lines is not last:
            self._compiled[name] = lines
        return lines.text

    def _reference_histogram(self, t: _Template, rows: dict[LabelValues, list[float]]) -> bytes:
        text: list[str] = []
        name, bounds = t.metric.name, _BOUNDS[t.metric.name]
        for lv, row in sorted(rows.items()):
            _histogram_lines(text, name, bounds, t.bucket_labels(lv), t.labels(lv), row[:-1], row[-1],
                             "_count", "_sum")
        return "".join(text).encode("utf-8")

    def _compiled_histogram(self, t: _Template, rows: dict[LabelValues, list[float]]) -> bytes:
        """The family's lines written in C from a layout kept while its series stay the same."""
        name = t.metric.name
        if type(rows) is not dict:
            rows = dict(rows)
        layout = self._histogram_layouts.get(name)
        text = None if layout is None else _render_core.histogram_lines(layout, rows)
        if text is None:
            layout = self._histogram_layout(t, rows, layout)
            text = _render_core.histogram_lines(layout, rows)
            if text is None:  # a row of another length than the buckets: as the reference writes it
                return self._reference_histogram(t, rows)
        return text

    def _histogram_layout(self, t: _Template, rows: dict[LabelValues, list[float]],
                          last: _render_core.HistogramLayout | None) -> _render_core.HistogramLayout:
        """A layout for ``rows``' series. Series that eviction ages or a new worker add come in a
        few at a time: when all of the last layout's series are still there, the new ones are
        placed in its sorted order by bisection and only they get prefixes written."""
        name = t.metric.name
        known = self._histogram_series.get(name, {})
        new = [lv for lv in rows if lv not in known]
        if last is not None and len(rows) - len(new) == len(known) == last.n:
            keys = list(last.keys)
            for lv in sorted(new):
                insort(keys, lv)
            made = dict(known)
        else:
            keys = sorted(rows)
            made = {lv: known[lv] for lv in keys if lv in known}
        bounds = _BOUNDS[name]
        for lv in new:
            bucket, plain = t.bucket_labels(lv), t.labels(lv)
            made[lv] = _render_core.SeriesPrefixes([*(f"{name}_bucket{bucket(le)} ".encode() for le in bounds),
                                                    f"{name}_count{plain} ".encode(), f"{name}_sum{plain} ".encode()])
        self._histogram_series[name] = made
        layout = self._histogram_layouts[name] = _render_core.HistogramLayout(
            tuple(keys), tuple(map(made.__getitem__, keys)), len(bounds))
        return layout

    def _reference_lines(self, t: _Template, values: dict[LabelValues, float]) -> bytes:
        name = t.metric.sample_name
        fam = self._families.get(name)
        if fam is not None and len(fam.keys) == len(values):
            try:
                ordered = fam.get(values)
            except KeyError:  # another label set in place of a cached one
                fam = None
        else:
            fam = None
        if fam is None:
            keys = tuple(sorted(values))
            prefixes = [t.prefix(lv) for lv in keys]
            get = _getter(keys)
            ordered = get(values)
        else:
            keys, prefixes, get = fam.keys, fam.prefixes, fam.get
        packed = array("d", ordered)
        raw = packed.tobytes()
        if fam is None:
            texts = _value_texts(packed.tolist())
        elif raw == fam.raw:
            return fam.text
        else:
            texts = _changed_texts(fam.texts, fam.raw, raw, packed.tolist())
        text = _joined(prefixes, texts)
        self._families[name] = _Family(keys, get, prefixes, raw, texts, text)
        return text

    def render(self, series: Series) -> bytes:
        """The text exposition of every catalogue metric whose source signal is available."""
        signals = series.signals
        out: list[bytes] = []
        for t, header in zip(TEMPLATES, _HEADERS, strict=True):
            m = t.metric
            if m.source not in ALWAYS and not signals.get(m.source, False):
                continue
            out.append(header)
            if m.type == "counter" or m.type in ("gauge", "info"):
                values = series.counters if m.type == "counter" else series.gauges
                out.append(self._lines(t, values.get(m.name, {})))
                continue
            if m.type == "histogram":
                out.append(self._histogram(t, series.histograms.get(m.name, {})))
                continue
            # a gauge histogram: _bucket here, then the _gcount and _gsum gauges as families of their own
            obs = series.gaugehistograms.get(m.name)
            if obs is None:
                continue
            counts, total = bucket_counts(m.buckets or (), obs)
            text: list[str] = []
            tail: list[str] = []
            _histogram_lines(text, m.name, _BOUNDS[m.name], t.bucket_labels(()), "", counts, total,
                             "_gcount", "_gsum", tail)
            for suffix, line in zip(("_gcount", "_gsum"), tail, strict=True):
                text.append(_header(m.name + suffix, m.help, "gauge"))
                text.append(line)
            out.append("".join(text).encode("utf-8"))
        return b"".join(out)


_RENDERER = Renderer()


def render(series: Series) -> bytes:
    """The text exposition of every catalogue metric whose source signal is available."""
    return _RENDERER.render(series)


class CollectorPause:
    """Automatic garbage collection held off while a scrape runs.

    A scrape allocates tens of thousands of objects (the gathered series, the text's pieces) and
    drops them all when it ends: none outlives it, and reference counting frees every one. A
    collection that runs meanwhile only finds them alive and promotes them, so each scrape
    pushed a page's worth of objects into the oldest generation, and every few scrapes that
    made the interpreter collect the whole heap — the state's every object, ~50 ms at 1,000
    workers — inside a scrape. Paused, the scrape's objects never reach an older generation
    and nothing of the state is walked on its account. Scrapes that overlap share one pause;
    a pause held longer than ``max_s`` (scrapes overlapping without a gap) is not extended by
    a new one, so the other threads' garbage is never left uncollected for long.
    """

    def __init__(self, max_s: float = 1.0) -> None:
        self.max_s = max_s
        self._lock = threading.Lock()
        self._active = 0
        self._paused = False  # this pause disabled automatic collection (and re-enables it)
        self._since = 0.0

    def __enter__(self) -> None:
        with self._lock:
            if self._active == 0:
                if gc.isenabled():
                    gc.disable()
                    self._paused, self._since = True, time.monotonic()
            elif self._paused and time.monotonic() - self._since > self.max_s:
                gc.enable()
                self._paused = False
            self._active += 1

    def __exit__(self, *_exc: object) -> None:
        with self._lock:
            self._active -= 1
            if self._active == 0 and self._paused:
                gc.enable()
                self._paused = False


_PAUSE = CollectorPause()


def render_state(state: ClusterState) -> bytes:
    """One scrape: the state's current series (under its lock), then the text outside it, with
    automatic garbage collection paused meanwhile (:class:`CollectorPause`)."""
    with _PAUSE:
        return render(state.snapshot_for(lambda st: st.series()))
