"""The shared validator: schemas run, problems worded for people, paths dotted and indexed."""

from __future__ import annotations

import pytest

from prefixscope import SCHEMAS_DIR
from prefixscope.validation import Problems, expected, path_text, schema_problems, show, validator

CONFIG_SCHEMAS = ("thresholds.v1.json", "topology.v1.json", "exporter-config.v1.json", "relay-config.v1.json",
                  "scenario.v1.json")


@pytest.mark.parametrize("name", CONFIG_SCHEMAS)
def test_every_config_schema_is_valid_draft_2020_12(name: str) -> None:
    assert (SCHEMAS_DIR / name).is_file()
    assert validator(name).schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_paths_are_dotted_and_indexed() -> None:
    assert path_text(["workers", 3, "prefill_tps"]) == "workers[3].prefill_tps"
    assert path_text(["checks", "prefix_hit_rate_total", "value"]) == "checks.prefix_hit_rate_total.value"
    assert path_text([]) == ""


def test_values_are_shown_as_written() -> None:
    assert [show(v) for v in ("high", True, None, 1.5, [5, 2], {"a": 1})] == \
        ['"high"', "true", "nothing", "1.5", "[5, 2]", "a mapping"]


def test_expectations_read_as_words() -> None:
    assert expected({"type": "integer", "minimum": 1}) == "a positive integer"
    assert expected({"type": "number", "minimum": 0, "maximum": 1}) == "a number between 0 and 1"
    assert expected({"enum": ["a", "b"]}) == "one of a, b"
    assert expected({"type": ["string", "null"], "format": "duration"}) == "a duration like 5m or 1h30m"


def test_problems_render_as_file_path_problem_and_collect_all() -> None:
    p = Problems("topology.yaml")
    data = {"model": "m", "workers": [{"name": "a", "node": "n", "nvlink_domain": "d", "gpu_class": "H100",
                                       "prefill_tps": "fast", "colour": "red"}, {"name": "b"}], "block_size": 0}
    assert not p.check_schema(data, "topology.v1.json")
    assert set(p.lines) == {
        "topology.yaml: block_size: expected a positive integer, got 0",
        'topology.yaml: workers[0].prefill_tps: expected a positive number, got "fast"',
        "topology.yaml: workers[0].colour: unknown field (allowed: name, node, nvlink_domain, gpu_class, gpus, "
        "warm_pool, prefill_tps, decode_tps, kv_blocks, intra_node_gbps, inter_node_gbps, price_per_gpu_hour, "
        "max_concurrency)",
        "topology.yaml: workers[1].node: missing",
        "topology.yaml: workers[1].nvlink_domain: missing",
        "topology.yaml: workers[1].gpu_class: missing",
    }
    assert p.has("workers[0]") and p.has("workers") and not p.has("model")


def test_non_finite_numbers_are_refused() -> None:
    data = {"model": "m", "workers": [{"name": "a", "node": "n", "nvlink_domain": "d", "gpu_class": "H100",
                                       "prefill_tps": float("inf")}]}
    assert schema_problems(data, "topology.v1.json") == [("workers[0].prefill_tps", "expected a finite number, got inf")]
