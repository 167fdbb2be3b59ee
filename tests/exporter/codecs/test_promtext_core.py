"""The compiled page scanner against the Python reference: equal ``ParseResult``s for every text.

``promtext.parse`` runs ``exporter.codecs._promtext_core`` on ASCII pages; ``parse_reference`` is the
definition. Each text is read both ways, with no name filter and with the worker names, with
no series cache, a fresh one and a warm one (the second scrape of a page).
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.codecs import normalize, promtext

pytestmark = pytest.mark.skipif(promtext.CORE != "compiled", reason="the compiled scanner is not built")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PAGES = sorted(p.name for p in FIXTURES.glob("*.txt"))
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _same(a: promtext.ParseResult, b: promtext.ParseResult) -> bool:
    """Equal, with NaN equal to NaN (``ParseResult.__eq__`` compares floats with ==)."""
    def norm(r: promtext.ParseResult) -> tuple:
        samples = [(name, [(s.labels, "NaN" if math.isnan(s.value) else s.value, s.timestamp) for s in ss])
                   for name, ss in r.samples.items()]
        return samples, r.errors, r.lines, r.other_names, r.families
    return norm(a) == norm(b)


def check(text: str) -> None:
    for wanted in (None, normalize.WORKER_NAMES, {"m", "odd", "good"}):
        want = promtext.parse_reference(text, wanted)
        assert _same(promtext.parse(text, wanted), want), (text, wanted)
        cache = promtext.SeriesCache()
        assert _same(promtext.parse(text, wanted, cache=cache), want), (text, wanted)
        assert _same(promtext.parse(text, wanted, cache=cache), want), (text, wanted)  # from the cache


@pytest.mark.parametrize("page", PAGES)
def test_fixture_pages(page: str) -> None:
    check((FIXTURES / page).read_text())


@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_simulated_worker_pages(flavour: str) -> None:
    from bench.parse import worker_page

    check(worker_page(flavour))


EDGES = [
    # escapes, NaN and infinities, timestamps, trailing commas, colons, a "}" inside a value
    r'''odd{path="C:\\dir",q="say \"hi\"",nl="a\nb"} 1.5
odd{empty=""} NaN
odd{trailing="comma",} +Inf 1700000000000
odd_neg -Inf
ns:sub:name{a="x y } z"} 2e3
ns:sub:name   7   1700000000123
m{a="\q"} 1
m{a="1"} nan
m{a="1"} -nan
m{a="1"} inf
m{a="1"} Infinity
m{a="1"} -0
m{a="1"} 0x10
m{a="1"} 1_000
m{a="1"} 1e999
m{a="1"} 4.9e-324
m{a="1"} .5 -1.5e3
m{a="1"} 1 2 3
m{a="1"}1
m {a="1"} 1
m{a="1",a="2"} 1
m{a="1" , b = "2" } 1
m{,} 1
m{} 1
m{ } 1
m{a="1"}} 1
m{a="1"} 1 }
m{a="unterminated} 1
m{a="1" 1
m{1a="x"} 1
#
# TYPE
# TYPE a_family counter extra
# TYPE lone
# HELP m a help text with "quotes" and \\ escapes
## a comment
#TYPE not_a_type gauge
m
good 1
good notanumber
<html><body>oops</body></html>
''',
    # odd blanks and control characters (str.split() splits on \v, \f, \r and \x1c-\x1f too)
    "m\t1\nm 1\t2\nm\t 1\n m 1\nm 1\v\nm\x0b1\nm 1\x1c2\nm 1\x1f\nm 1\x00\nm\x00 1\nm 1\r\nm 1\r\r\n"
    'm{a="x\ry"} 1\nm 1\x0c\nm  1  2  \n\r\n\x7f 1\nm 1\x7f\n',
    # OpenMetrics: exemplars, _created, units, # EOF, +Inf buckets
    '''# TYPE req_seconds histogram
# UNIT req_seconds seconds
req_seconds_bucket{le="0.1"} 3 # {trace_id="abc123"} 0.05 1700000000.123
req_seconds_bucket{le="+Inf"} 5 # {} 1
req_seconds_count 5
req_seconds_sum 0.4
req_seconds_created 1.7e9
# TYPE info_thing info
info_thing_info{version="1.0"} 1
# TYPE st stateset
st{st="a"} 1
# EOF
''',
    "",
    "\n",
    "m 1",
    "m 1\n" * 5,
    'm{a="' + "x" * 300 + '"} 1\n' + 'm{a="' + "y" * 2000 + '"} 2\n',  # past the cache's key length and the label cap
]


@pytest.mark.parametrize("text", EDGES)
def test_edge_cases(text: str) -> None:
    check(text)


def test_every_line_of_the_edge_cases_with_every_line_ending() -> None:
    for line in [line for text in EDGES[:3] for line in text.split("\n")]:
        for tail in ("", "\n", "\r\n", "\nm 1"):
            check(line + tail)


def test_a_warm_cache_keeps_reading_new_values_and_new_series() -> None:
    cache = promtext.SeriesCache()
    promtext.parse('m{a="1"} 1\nm{a="2"} 2\n', cache=cache)
    got = promtext.parse('m{a="1"} 5 1000\nm{a="3"} 6\nm{a="2"} 7\n', cache=cache)
    assert [(s.labels, s.value, s.timestamp) for s in got.values("m")] == [
        ({"a": "1"}, 5.0, 1.0), ({"a": "3"}, 6.0, None), ({"a": "2"}, 7.0, None)]
    assert set(cache) == {'m{a="1"}', 'm{a="2"}', 'm{a="3"}'}


def test_the_cache_is_bounded() -> None:
    cache = promtext.SeriesCache()
    lines = "".join(f'm{{a="{i}"}} 1\n' for i in range(promtext.CACHE_SERIES + 10))
    result = promtext.parse(lines, cache=cache)
    assert len(result.values("m")) == promtext.CACHE_SERIES + 10 and result.errors == []
    assert len(cache) <= promtext.CACHE_SERIES
    long = 'm{a="' + "x" * promtext.CACHE_KEY_CHARS + '"} 1\n'
    promtext.parse(long, cache=cache)
    assert all(len(k) <= promtext.CACHE_KEY_CHARS for k in cache)


def test_non_ascii_pages_are_read_by_the_reference() -> None:
    text = 'm{a="é"} 1\nm{a="\u2028"} 2\n'
    assert _same(promtext.parse(text, cache=promtext.SeriesCache()), promtext.parse_reference(text))


def test_a_parse_past_its_deadline_stops() -> None:
    with pytest.raises(promtext.ParseTimeout):
        promtext.parse("m 1\n" * (promtext.DEADLINE_EVERY * 2), deadline=0.0, cache=promtext.SeriesCache())


ALPHABET = st.sampled_from([*'m{}="\\, \t\r\n#_:a1.e+-NIn', "\x0b", "\x1c", "\x00", "Inf", "NaN", "# TYPE ",
                            'm{a="x"} ', " 1700000000000", "\\n", "le="])


@SETTINGS
@given(st.lists(ALPHABET, max_size=60).map("".join))
def test_generated_texts(text: str) -> None:
    check(text)


@SETTINGS
@given(st.text(st.characters(max_codepoint=127), max_size=200))
def test_generated_ascii_texts(text: str) -> None:
    check(text)


def test_mutated_pages() -> None:
    rng = random.Random(7)
    pages = [(FIXTURES / p).read_text() for p in PAGES]
    for _ in range(300):
        chars = list(rng.choice(pages))
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(chars))
            chars[i] = rng.choice('{}"\\ \n\t=,#x1.')
        check("".join(chars))


def test_without_the_extension_the_reference_parses() -> None:
    repo = Path(__file__).resolve().parents[3]
    code = ("import sys; sys.modules['exporter.codecs._promtext_core'] = None\n"
            "from exporter.codecs import promtext as p\n"
            "print(p.CORE, p.parse('m{a=\"1\"} 2\\n', cache=p.SeriesCache()).values('m')[0].value)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo,
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["reference", "2.0"], out.stderr
    assert out.stderr.count("/metrics parser: the Python reference") == 1
