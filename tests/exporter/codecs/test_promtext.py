"""The fast text-format parser against prometheus_client's parser and hand-written edge cases."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.codecs import promtext

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
PAGES = sorted(p.name for p in FIXTURES.glob("*.txt"))


def _reference(text: str) -> set[tuple]:
    return {(s.name, tuple(sorted(s.labels.items())), _v(s.value))
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def _ours(result: promtext.ParseResult) -> set[tuple]:
    return {(name, tuple(sorted(s.labels.items())), _v(s.value)) for name, ss in result.samples.items() for s in ss}


def _v(x: float) -> object:
    return "NaN" if math.isnan(x) else x


@pytest.mark.parametrize("page", PAGES)
def test_every_sample_matches_prometheus_client(page: str) -> None:
    text = (FIXTURES / page).read_text()
    result = promtext.parse(text)
    assert result.errors == []
    assert _ours(result) == _reference(text)


def test_wanted_names_only_and_unwanted_lines_skipped() -> None:
    text = (FIXTURES / "vllm_0_33_dp2.txt").read_text()
    wanted = {"vllm:prefix_cache_hits_total", "vllm:cache_config_info"}
    result = promtext.parse(text, wanted)
    assert set(result.samples) == wanted
    assert sorted(s.value for s in result.values("vllm:prefix_cache_hits_total")) == [2000.0, 24000.0]
    assert result.values("vllm:cache_config_info")[0].labels["num_gpu_blocks"] in {"1000", "3000"}
    assert "vllm:time_to_first_token_seconds_bucket" in result.other_names
    assert result.errors == []


EDGE = r'''# HELP odd a metric with "quotes" in help
# TYPE odd gauge
odd{path="C:\\dir",q="say \"hi\"",nl="a\nb"} 1.5
odd{empty=""} NaN
odd{trailing="comma",} +Inf 1700000000000
odd_neg -Inf
ns:sub:name{a="x y } z"} 2e3
ns:sub:name   7   1700000000123
'''


def test_escapes_special_values_timestamps_and_colons() -> None:
    result = promtext.parse(EDGE)
    assert result.errors == []
    odd = result.values("odd")
    assert odd[0].labels == {"path": "C:\\dir", "q": 'say "hi"', "nl": "a\nb"}
    assert odd[0].value == 1.5 and odd[0].timestamp is None
    assert math.isnan(odd[1].value) and odd[1].labels == {"empty": ""}
    assert odd[2].value == math.inf and odd[2].timestamp == 1_700_000_000.0
    assert result.values("odd_neg")[0].value == -math.inf
    colon = result.values("ns:sub:name")
    assert colon[0].labels == {"a": "x y } z"} and colon[0].value == 2000.0
    assert colon[1].value == 7.0 and colon[1].timestamp == pytest.approx(1_700_000_000.123)
    assert _ours(result) == _reference(EDGE)


def test_malformed_lines_are_reported_and_the_rest_kept() -> None:
    text = "\n".join([
        "good 1",
        "good{a=\"1\"} notanumber",          # 2: bad value
        "good{a=\"unterminated} 3",         # 3: bad label block
        "good{a=\"2\"} 4",
        "<html><body>oops</body></html>",   # 5: not a metric name
        "good{a=\"3\"} 5 6 7",               # 6: too many fields
        "good{a=\"4\" 8",                    # 7: no closing brace
        "",
        "good{a=\"5\"} 9",
    ])
    result = promtext.parse(text, {"good"})
    assert [e.line for e in result.errors] == [2, 3, 5, 6, 7]
    assert "notanumber" in result.errors[0].excerpt
    assert "invalid metric name" in str(result.errors[2])
    assert [s.value for s in result.values("good")] == [1.0, 4.0, 9.0]


def test_long_excerpt_is_truncated() -> None:
    result = promtext.parse("x " + "y" * 500, {"x"})
    assert len(result.errors) == 1
    assert len(result.errors[0].excerpt) <= promtext.EXCERPT_CHARS + 1


def test_empty_and_comment_only_text() -> None:
    assert promtext.parse("").samples == {}
    result = promtext.parse("# HELP a b\n# TYPE a counter\n\n")
    assert result.samples == {} and result.errors == [] and result.lines == 0


@pytest.mark.parametrize("flavour", ["vllm", "vllm-legacy", "sglang"])
def test_simulated_worker_pages_match_prometheus_client(flavour: str) -> None:
    from bench.parse import worker_page

    text = worker_page(flavour)
    result = promtext.parse(text)
    assert result.errors == [] and result.lines > 100
    assert _ours(result) == _reference(text)


@pytest.mark.parametrize("value", ["x" * 1_000_000, "\\\\" * 500_000, '\\"' * 500_000])
def test_long_label_lines_are_read_in_one_pass(value: str) -> None:
    # A backtracking label regex needs minutes for these (quadratic); the scanner, milliseconds.
    for line in (f'm{{a="{value}"}} 1', f'm{{a="{value} 1', f'm{{a="{value}}} 1', f'm{{a="{value}", b="x"}} 1'):
        result = promtext.parse(line + "\nm 2")
        assert [s.value for s in result.values("m")] == [2.0] and len(result.errors) == 1


def test_label_value_with_a_lone_surrogate_or_undecodable_bytes_is_rejected() -> None:
    text = b'm{a="ok"} 1\nm{a="\xed\xa0\x80"} 2\nm{a="\xff"} 3\n'.decode("utf-8", "surrogateescape") + 'm{a="\ud800"} 4\n'
    result = promtext.parse(text)
    assert [s.value for s in result.values("m")] == [1.0]
    assert [(e.line, e.kind) for e in result.errors] == [(2, "label_value"), (3, "label_value"), (4, "label_value")]


def test_lines_end_at_newline_only() -> None:
    result = promtext.parse('m{a="x\u2028y\x85z"} 1\r\nm 2\r\n')
    assert [s.labels for s in result.values("m")] == [{"a": "x\u2028y\x85z"}, {}] and result.errors == []


def test_a_parse_past_its_deadline_stops() -> None:
    with pytest.raises(promtext.ParseTimeout):
        promtext.parse("m 1\n" * (promtext.DEADLINE_EVERY * 2), deadline=0.0)
