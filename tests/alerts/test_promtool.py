"""The generated rule files pass the real promtool: syntax, and unit tests of every alert."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from tests.support import require_tool

ROOT = Path(__file__).resolve().parents[2]
GEN = ROOT / "alerts" / "generated"


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([require_tool("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_check_rules_on_the_rule_file() -> None:
    done = _promtool("check", "rules", "prefixscope.rules.yaml", cwd=GEN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout


def test_check_rules_on_the_prometheusrule_spec(tmp_path: Path) -> None:
    manifest = yaml.safe_load((GEN / "prefixscope.prometheusrule.yaml").read_text(encoding="utf-8"))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(manifest["spec"]), encoding="utf-8")
    done = _promtool("check", "rules", "spec.yaml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def test_generated_unit_tests_pass() -> None:
    done = _promtool("test", "rules", "prefixscope.rules.test.yaml", cwd=GEN)
    assert done.returncode == 0, done.stdout + done.stderr


def test_handwritten_unit_tests_pass() -> None:
    here = Path(__file__).resolve().parent
    done = _promtool("test", "rules", "handwritten.test.yaml", cwd=here)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_wrong_expectation_fails(tmp_path: Path) -> None:
    """The generated cases are not vacuous: a changed expected description makes promtool fail."""
    tests = yaml.safe_load((GEN / "prefixscope.rules.test.yaml").read_text(encoding="utf-8"))
    fired = next(t for t in tests["tests"] if t["alert_rule_test"][0]["exp_alerts"])
    fired["alert_rule_test"][0]["exp_alerts"][0]["exp_annotations"]["description"] += " (changed)"
    silent = next(t for t in tests["tests"] if not t["alert_rule_test"][0]["exp_alerts"])
    silent["alert_rule_test"][0]["exp_alerts"] = fired["alert_rule_test"][0]["exp_alerts"]
    shutil.copy(GEN / "prefixscope.rules.yaml", tmp_path)
    (tmp_path / "t.yaml").write_text(yaml.safe_dump({**tests, "tests": [fired, silent]}), encoding="utf-8")
    done = _promtool("test", "rules", "t.yaml", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stdout.count("FAILED") + done.stderr.count("FAILED") >= 1
    assert "(changed)" in done.stdout + done.stderr


def _run_case(tmp_path: Path, case: dict) -> subprocess.CompletedProcess[str]:
    shutil.copy(GEN / "prefixscope.rules.yaml", tmp_path)
    doc = {"rule_files": ["prefixscope.rules.yaml"], "evaluation_interval": "1m", "tests": [case]}
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(doc), encoding="utf-8")
    return _promtool("test", "rules", "t.yaml", cwd=tmp_path)


def _firing(alert: str, at: str, labels: dict[str, str]) -> dict:
    """ALERTS as Prometheus keeps it: one firing sample with the alert's labels (or none, with {})."""
    samples = [{"labels": "ALERTS" + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(
        {"alertname": alert, "alertstate": "firing", **labels}.items())) + "}", "value": 1}] if labels else []
    return {"expr": f'ALERTS{{alertname="{alert}", alertstate="firing"}}', "eval_time": at, "exp_samples": samples}


def test_a_stray_kv_batch_during_a_fault_does_not_resolve_the_alert(tmp_path: Path) -> None:
    """keep_firing_for: a silent publisher that sends one stray batch at minute 10 keeps its alert
    (per worker, in its cluster) instead of resolving and firing again; the healthy cluster stays quiet."""
    labels = {"cluster": "a", "severity": "warning", "step": "0", "worker": "w0"}
    case = {
        "interval": "1m",
        "input_series": [
            # silent from the start, one batch received at minute 10, silent again
            {"series": 'prefixscope_kv_event_last_timestamp_seconds{cluster="a", worker="w0"}',
             "values": "0x9 600x20"},
            {"series": 'prefixscope_kv_event_last_timestamp_seconds{cluster="b", worker="w0"}',
             "values": "0+60x30"},
        ],
        "promql_expr_test": [_firing("PrefixTelemetryKvEventsStale", "9m", labels),
                             _firing("PrefixTelemetryKvEventsStale", "12m", labels),
                             _firing("PrefixTelemetryKvEventsStale", "14m", labels)],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr


# ---- a family shard that is not scraped ---------------------------------------------------------
HIT_RULE = "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"
RESIDENT_RULE = "worker:prefixscope_worker_resident_blocks_per_capacity:ratio"


def _hit_tokens(cluster: str, worker: str, shard: str, hit: str, queried: str) -> list[dict]:
    """A worker's engine counters as its home shard exports them."""
    labels = f'cluster="{cluster}", instance="shard{shard}", model="m", worker="{worker}"'
    return [{"series": f"prefixscope_prefix_cache_hit_tokens_total{{{labels}}}", "values": hit},
            {"series": f"prefixscope_prefix_cache_queried_tokens_total{{{labels}}}", "values": queried}]


def _shard(cluster: str, shard: str, values: str) -> dict:
    return {"series": f'prefixscope_exporter_shards{{cluster="{cluster}", instance="shard{shard}", shard="{shard}"}}',
            "values": values}


def _samples(expr: str, at: str, *values: tuple[str, float]) -> dict:
    return {"expr": expr, "eval_time": at, "exp_samples": [{"labels": labels, "value": v} for labels, v in values]}


def test_a_dead_shard_fires_its_alert_and_withholds_the_pooled_ratio_instead_of_reweighting_it(tmp_path: Path) -> None:
    """Cluster a's three shards: shard 0 is home to w0 (30 of 60 tokens hit a minute), shard 1 to w1
    (0 of 60). Shard 1 dies at minute 11 (the stale markers of its failed scrape) and is back at 21.
    The cluster hit rate is 0.25 while all report; with shard 1 gone, the survivors alone read 0.5
    (the unguarded pool, once shard 1's samples have left the window), so the rule is withheld
    instead — in cluster a only — and PrefixExporterShardDown fires for shard 1 after its `for`
    (1m). Back, the shard resolves the alert and the rule returns with the cluster's value."""
    dead = "0x10 stale _x9 3x10"  # shard 1's samples: scraped to minute 10, gone 11-20, back from 21
    case = {
        "interval": "1m",
        "input_series": [
            _shard("a", "0", "3x31"), _shard("a", "1", dead.replace("0x10", "3x10")), _shard("a", "2", "3x31"),
            *_hit_tokens("a", "w0", "0", "0+30x31", "0+60x31"),
            *_hit_tokens("a", "w1", "1", "0x10 stale _x9 0x10", "0+60x10 stale _x9 0+60x10"),
            # cluster b: one unsharded exporter, all along
            {"series": 'prefixscope_exporter_shards{cluster="b", instance="one", shard="0"}', "values": "1x31"},
            *_hit_tokens("b", "w0", "0", "0+15x31", "0+60x31"),
        ],
        "promql_expr_test": [
            _samples(HIT_RULE, "10m", (f'{HIT_RULE}{{cluster="a"}}', 0.25), (f'{HIT_RULE}{{cluster="b"}}', 0.25)),
            # withheld from the first failed scrape on, never moved
            _samples(HIT_RULE, "11m", (f'{HIT_RULE}{{cluster="b"}}', 0.25)),
            _samples(HIT_RULE, "17m", (f'{HIT_RULE}{{cluster="b"}}', 0.25)),
            # what the rule would have said: the survivors' ratio
            _samples('sum by (cluster) (rate(prefixscope_prefix_cache_hit_tokens_total{cluster="a"}[5m])) / '
                     'sum by (cluster) (rate(prefixscope_prefix_cache_queried_tokens_total{cluster="a"}[5m]))',
                     "17m", ('{cluster="a"}', 0.5)),
            _firing("PrefixExporterShardDown", "11m", {}),  # pending for its `for`
            _firing("PrefixExporterShardDown", "12m", {"cluster": "a", "shard": "1", "severity": "warning", "step": "0"}),
            _firing("PrefixExporterShardDown", "20m", {"cluster": "a", "shard": "1", "severity": "warning", "step": "0"}),
            # back: resolved, and the cluster's value again once its counters fill the window
            _firing("PrefixExporterShardDown", "21m", {}),
            _samples(HIT_RULE, "27m", (f'{HIT_RULE}{{cluster="a"}}', 0.25), (f'{HIT_RULE}{{cluster="b"}}', 0.25)),
        ],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr


def test_resident_blocks_of_a_worker_are_withheld_while_one_of_its_family_shards_is_missing(tmp_path: Path) -> None:
    """Each family shard exports its part of a worker's resident blocks (600 + 400 of 2000): with
    shard 1 gone the worker would read 30 % full instead of 50 %; it reads nothing."""
    case = {
        "interval": "1m",
        "input_series": [
            _shard("a", "0", "2x10"), _shard("a", "1", "2x4 stale"),
            {"series": 'prefixscope_worker_resident_blocks{cluster="a", instance="shard0", worker="w0"}',
             "values": "600x10"},
            {"series": 'prefixscope_worker_resident_blocks{cluster="a", instance="shard1", worker="w0"}',
             "values": "400x4 stale"},
            {"series": 'prefixscope_worker_capacity_blocks{cluster="a", instance="shard0", worker="w0"}',
             "values": "2000x10"},
        ],
        "promql_expr_test": [
            _samples(RESIDENT_RULE, "4m", (f'{RESIDENT_RULE}{{cluster="a", worker="w0"}}', 0.5)),
            _samples(RESIDENT_RULE, "5m"),
            _samples(RESIDENT_RULE, "9m"),
        ],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_shard_never_seen_alerts_for_its_scope_and_a_plan_scaled_in_misses_nobody(tmp_path: Path) -> None:
    """Cluster a: shards 0 and 2 of 3 report, shard 1 never did (no history to name it): one alert
    for the scope, the pooled rule withheld. Cluster b scales in from 3 shards to 2 at minute 5: the
    old shard 2 is not missed and the rule stands."""
    case = {
        "interval": "1m",
        "input_series": [
            _shard("a", "0", "3x20"), _shard("a", "2", "3x20"),
            *_hit_tokens("a", "w0", "0", "0+30x20", "0+60x20"),
            _shard("b", "0", "3x4 2x15"), _shard("b", "1", "3x4 2x15"), _shard("b", "2", "3x4 stale"),
            *_hit_tokens("b", "w0", "0", "0+30x20", "0+60x20"),
        ],
        "promql_expr_test": [
            _samples(HIT_RULE, "15m", (f'{HIT_RULE}{{cluster="b"}}', 0.5)),
            _firing("PrefixExporterShardDown", "15m", {"cluster": "a", "severity": "warning", "step": "0"}),
        ],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr


def _cold_prefill(cluster: str, phases: list[tuple[int, float]]) -> list[dict]:
    """Cold-prefill bucket counters of one model and prompt class: 10 requests a minute, each
    phase (minutes, prefill seconds) landing in the bucket of its prefill time."""
    from prefixscope.catalog import PREFILL_BUCKETS
    out = []
    for le in [*PREFILL_BUCKETS, float("inf")]:
        total, parts = 0, []
        for minutes, seconds in phases:
            step = 10 if seconds <= le else 0
            parts.append(f"{total}+{step}x{minutes}")
            total += step * minutes + step  # the next phase starts one step on
        bound = "+Inf" if le == float("inf") else f"{le:g}"
        out.append({"series": "prefixscope_cold_prefill_seconds_bucket{" + f'cluster="{cluster}", gpu_class="g", '
                    f'le="{bound}", model="m", prompt_class="1k-4k"' + "}", "values": " ".join(parts)})
    return out


def test_a_two_hour_cold_prefill_slowdown_still_alerts_after_one_and_two_hours(tmp_path: Path) -> None:
    """The baseline leaves out the windows in which the check breached: a 5 × slowdown lasting two
    hours (0.45 s → 2.25 s, under the class's 2.5 s budget) is still compared with the fleet before
    it at +1 h and +2 h, where a plain day-long p99 had absorbed it within half an hour. The
    healthy cluster beside it stays quiet."""
    labels = {"cluster": "a", "severity": "warning", "step": "3"}
    case = {
        "interval": "1m",
        "input_series": _cold_prefill("a", [(180, 0.45), (120, 2.25)]) + _cold_prefill("b", [(300, 0.45)]),
        "promql_expr_test": [_firing("PrefixColdPrefillSlow", "170m", {}),
                             _firing("PrefixColdPrefillSlow", "190m", labels),
                             _firing("PrefixColdPrefillSlow", "240m", labels),
                             _firing("PrefixColdPrefillSlow", "299m", labels),
                             _firing("PrefixColdPrefillOverBudget", "299m", {})],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr


def test_one_wiped_worker_among_healthy_ones_is_named_in_step_1(tmp_path: Path) -> None:
    """Twelve workers with the same traffic, eleven at a 0.94 hit ratio and one whose cache is wiped
    (0.13): the cluster reads 0.8725, above PrefixHitRateLow's line, and PrefixWorkerHitRateOutlier
    names step 1 and that worker (0.13 / 0.94 of its peers' median) in its cluster only."""
    def worker(cluster: str, name: str, hit: float) -> list[dict]:
        sel = f'cluster="{cluster}", model="m", worker="{name}"'
        return [{"series": f"prefixscope_prefix_cache_hit_tokens_total{{{sel}}}", "values": f"0+{600 * hit:g}x30"},
                {"series": f"prefixscope_prefix_cache_queried_tokens_total{{{sel}}}", "values": "0+600x30"}]
    series = [s for i in range(12) for s in worker("a", f"w{i}", 0.13 if i == 11 else 0.94)]
    series += [s for i in range(12) for s in worker("b", f"w{i}", 0.94)]
    cluster = "cluster:prefixscope_prefix_cache_hit_tokens_per_queried_tokens:ratio_rate5m"
    case = {
        "interval": "1m",
        "input_series": series,
        "promql_expr_test": [
            # (0.13 + 11 × 0.94) / 12, to four places: the sum's order (and so its last bit) is Prometheus's
            {"expr": f'round({cluster}{{cluster="a"}}, 0.0001)', "eval_time": "20m",
             "exp_samples": [{"labels": '{cluster="a"}', "value": 0.8725}]},
            _firing("PrefixHitRateLow", "20m", {}),
            _firing("PrefixWorkerHitRateOutlier", "20m",
                    {"cluster": "a", "severity": "warning", "step": "1", "worker": "w11"}),
        ],
    }
    done = _run_case(tmp_path, case)
    assert done.returncode == 0, done.stdout + done.stderr
