"""One duration grammar: what the threshold file accepts, the exporter's config accepts, same seconds.

The threshold file (``window:``, ``for:``) and the exporter's config (``window:`` and its
intervals) both read Prometheus durations; a value one accepts and the other rejects, or reads
as a different number of seconds, would make the generated rules and the exporter's own windows
disagree.
"""

from __future__ import annotations

import copy

import pytest
import yaml
from hypothesis import example, given
from hypothesis import strategies as st

from exporter.config import parse_config
from prefixscope.catalog import CHECKS
from prefixscope.thresholds import DEFAULT_PATH, ConfigError, parse

# Written out here, not taken from prefixscope.durations: the test states Prometheus's units.
UNIT_SECONDS = {"y": 365 * 86400, "w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1, "ms": 0.001}
UNITS = list(UNIT_SECONDS)  # largest first, as a duration must list them
BASE = yaml.safe_load(DEFAULT_PATH.read_text(encoding="utf-8"))
A_CHECK = next(iter(BASE["checks"]))
CHECK = next(c for c in CHECKS if c.threshold == A_CHECK)


@st.composite
def durations(draw: st.DrawFn) -> tuple[str, float]:
    """A Prometheus duration (units largest to smallest, each once) and its seconds."""
    units = sorted(draw(st.sets(st.sampled_from(UNITS), min_size=1)), key=UNITS.index)
    counts = [draw(st.integers(min_value=0, max_value=10_000)) for _ in units]
    text = "".join(f"{n}{u}" for n, u in zip(counts, units, strict=True))
    return text, sum(n * UNIT_SECONDS[u] for n, u in zip(counts, units, strict=True))


def thresholds_with(window: str, for_: str):
    data = copy.deepcopy(BASE)
    data["window"] = window
    data.pop("baseline_window", None)  # the default: a day, or twice a window of a day or more
    data["checks"][A_CHECK]["for"] = for_
    return parse(data, "thresholds.yaml")


@example(("1h30m", 5400.0))
@example(("500ms", 0.5))
@example(("1d", 86400.0))
@example(("2w", 1209600.0))
@given(durations())
def test_the_threshold_file_and_the_exporter_read_a_duration_alike(duration: tuple[str, float]) -> None:
    text, seconds = duration
    if seconds == 0:
        # `for: 0s` is Prometheus's "fire at once"; a window of nothing is no window, for either side.
        th = thresholds_with("5m", text)
        assert th.for_s(CHECK) == 0
        with pytest.raises(ConfigError, match="window"):
            thresholds_with(text, "5m")
        with pytest.raises(ValueError, match="window"):
            parse_config({"window": text})
        return
    th = thresholds_with(text, text)
    assert th.window_s == pytest.approx(seconds, rel=1e-12)
    assert th.for_s(CHECK) == th.window_s
    cfg = parse_config({"window": text, "tree_stats_interval": text})
    assert cfg.window == th.window_s
    assert cfg.tree_stats_interval == th.window_s


@pytest.mark.parametrize("text", ["5", "1.5m", "1m1h", "1h1h", "5 m", "-5m", "1H", "", "5mm"])
def test_what_the_threshold_file_rejects(text: str) -> None:
    with pytest.raises(ConfigError, match="window"):
        thresholds_with(text, "5m")
    with pytest.raises(ConfigError, match="for"):
        thresholds_with("5m", text)
