"""Every console page under Streamlit's AppTest, against a real exporter HTTP server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from console.settings import EXPORTER_ENV, GRAFANA_ENV, PROMETHEUS_ENV, RUNBOOK_BASE_ENV

FIRING = ":red[:material/error: FIRING]"
OK = ":green[:material/check_circle: ok]"
MISSING = ":gray[:material/help: not instrumented]"
NO_DATA = ":gray[:material/schedule: no data in the window]"
APP = str(Path(__file__).resolve().parents[2] / "console" / "streamlit_app.py")


def run(page: str | None = None) -> AppTest:
    at = AppTest.from_file(APP, default_timeout=30).run()
    if page is not None:
        at.switch_page(f"app_pages/{page}.py").run()
    assert not at.exception, at.exception
    return at


def texts(at: AppTest) -> str:
    parts = [m.value for m in at.markdown] + [e.value for e in at.error] + [w.value for w in at.warning]
    parts += [s.value for s in at.success] + [i.value for i in at.info] + [c.value for c in at.caption]
    return "\n".join(str(p) for p in parts)


def metrics(at: AppTest) -> dict[str, str]:
    return {m.label: m.value for m in at.metric}


def worker_tables(at: AppTest) -> dict:
    """The Workers & topology page's tables by name, told apart by their columns (st.dataframe
    keys do not reach AppTest)."""
    out = {}
    for frame in (d.value for d in at.dataframe):
        cols = list(frame.columns)
        name = ("removal_ranking" if "Safe-to-remove rank" in cols
                else "migrated_away" if "Sessions moved away (hard)" in cols else "domains" if "NVLink domain" in cols
                else "liveness" if "Liveness" in cols else "left_pool" if cols == ["Worker", "Resident blocks", "Node"]
                else "migrations")
        out.setdefault(name, frame)
    return out


def test_diagnosis_names_step_2_not_the_falling_hit_rate(exporter_only: str) -> None:
    at = run()
    # The headline: red, the failing step, its culprits and the runbook's first step.
    assert at.error[0].value.startswith("**FIRING** · Verdict: step 2 — Affinity.")
    assert "Failing: Sticky-session collisions." in at.error[0].value
    body = texts(at)
    # Sessions s0–s2 came back on w1 and reused half their prompt (cluster.py); w1 hit 41%.
    assert ("**Sessions**: s0: 50.0% of its follow-up tokens cached; the other sessions' median 100.0% (on w1) · "
            "s1: 50.0% of its follow-up tokens cached; the other sessions' median 100.0% (on w1)") in body
    # Collisions have no per-worker series: no worker is blamed (both hit 41%, alike).
    assert "**Workers**" not in body
    # The pool grew 1 → 2 in the window without a measured reshuffle: step 1 cannot be ruled out.
    assert "**First step** ([runbook](./runbook?alert=PrefixStickyCollisionsHigh), step 1): Reshuffle after" in body
    assert "Checked: a pool change (1 → 2 workers), its reshuffle not measured." in body
    # The symptom is shown, firing, but it is not the verdict (cluster.py: 410 / 1000 tokens).
    assert f"Symptom that starts the walk — **Prefix hit rate (cluster)**: 41.0% (alert when < 60.0%) — {FIRING}" in body
    assert f"**Sticky-session collisions**: 30.0% (alert when > 5.0%) — {FIRING}" in body
    assert f"**Session hit rate (follow-up turns)**: 85.0% (alert when < 80.0%) — {OK}" in body
    assert f"**Cache pressure (full and thrashing)**: 0.0% (alert when > 10.0%) — {OK}" in body
    # Not instrumented is neither ok nor an alarm, and says what is missing.
    assert f"### Step 3 — Cold-miss cost · {MISSING}" in body
    assert f"**Async prefill wait p99**: — (alert when > 5 s) — {MISSING} · missing signal: async_prefill" in body
    assert f"### Step 1 — Cache · {OK}" in body  # the falling hit rate alone does not fail step 1
    assert "Prometheus is not configured" in body
    # Nothing measured in the window on a source that exists is not "not instrumented".
    assert f"**Ingest errors**: — (alert when > 0.5/s) — {NO_DATA}" in body
    assert f"**Scrape targets up**: — (alert when > 0 targets) — {NO_DATA}" in body
    # Links go where something answers: the in-app runbook page; no Grafana is configured.
    assert "[runbook](./runbook?alert=PrefixStickyCollisionsHigh)" in body
    assert "Grafana panel" not in body
    assert "Charts over time need Prometheus" in body
    # Reuse of 1280 prompt tokens, judged by what the router faced: each first turn could have
    # reused w1's 2 blocks (10 × 32), each follow-up the whole chain (10 × 64) → 960 available;
    # 544 achieved; no router prediction, and no router saying anything of itself (missing, not 0).
    assert metrics(at) == {"Available": "75.0%", "Predicted": "—", "Achieved": "42.5%",
                           "Routing regret": "32.5%", "Index staleness": "—",
                           "Router predicted": "—", "Router regret": "—"}
    assert at.info[0].value.startswith("Routing: 75% was reusable somewhere")


def test_links_follow_the_configured_grafana_and_runbook_base(monkeypatch: pytest.MonkeyPatch,
                                                              exporter_only: str) -> None:
    monkeypatch.setenv(GRAFANA_ENV, "http://grafana.example:3000/")
    monkeypatch.setenv(RUNBOOK_BASE_ENV, "https://wiki.example/runbooks")
    at = run()
    body = texts(at)
    assert "[runbook](https://wiki.example/runbooks/PrefixStickyCollisionsHigh.md)" in body
    # The generated rules' panel of the alert, served from the configured Grafana.
    assert "[Grafana panel](http://grafana.example:3000/d/prefixscope-diagnosis-chain?viewPanel=" in body
    at.switch_page("app_pages/alerts.py").run()
    assert "[Grafana panel](http://grafana.example:3000/d/prefixscope-diagnosis-chain?viewPanel=" in texts(at)


def test_prefix_tree_page(exporter_only: str) -> None:
    at = run("prefix_tree")
    m = metrics(at)
    # One chain of 4 blocks (w1 holds its first 2): one radix node.
    assert (m["Nodes"], m["Blocks"], m["Root fan-out"]) == ("1", "4", "1")
    hot = at.dataframe[0].value
    assert hot["Cached tokens (window)"].tolist() == ["544 tokens"]  # 3 × 32 + 7 × 64 follow-up hits
    at.radio(key="tree_by").set_value("blocks").run()
    assert not at.exception


def test_prefix_tree_page_with_a_topology_and_a_pool_change(topology_only: str) -> None:
    """Hand-computed from topology_cluster.py (its docstring lays out every input)."""
    at = run("prefix_tree")
    m = metrics(at)
    # Radix nodes S, A, B, C; blocks 2 + 3 + 2 + 2; root children S1 and C1.
    assert (m["Nodes"], m["Blocks"], m["Root fan-out"]) == ("4", "9", "2")
    # Leaf depths in edges: A 2, B 2, C 1 → cumulative (le=1: 1, le=2: 3); rank 0.99 × 3 = 2.97
    # falls in (1, 2]: 1 + (2.97 − 1) / 2 = 1.985.
    assert m["Depth p99 (edges)"] == "1.98"  # three significant digits
    # S on w0, w1, w2 (2 blocks), A on w0, w1 (3), B on w2 and C on w3 (4): 5 of 9 duplicated.
    assert (m["Blocks on 1 worker"], m["On 2 workers"], m["On 3+ workers"]) == ("4", "3", "2")
    assert m["Duplicated share"] == "55.6%"
    hot, lost, rekeyed, pools = (d.value for d in at.dataframe)
    # Hits of the last 5 minutes: A 80 + 80 (u0, u1), C 32 + 32 (m0b, m1), S 32 (v0 on w0).
    # S is still in w2's cache, but w2 left the pool: it is not listed as holding the branch.
    assert hot[["Rank", "Branch", "Prefix", "Cached tokens (window)", "Blocks", "Workers", "Sessions"]].to_dict(
        "records") == [
        {"Rank": "1", "Branch": "1a1a0000", "Prefix": "—", "Cached tokens (window)": "160 tokens", "Blocks": "3 blocks",
         "Workers": "w0, w1", "Sessions": "2 sessions"},
        {"Rank": "2", "Branch": "1c1c0000", "Prefix": "—", "Cached tokens (window)": "64 tokens", "Blocks": "2 blocks",
         "Workers": "w3", "Sessions": "2 sessions"},
        {"Rank": "3", "Branch": "51510000", "Prefix": "—", "Cached tokens (window)": "32 tokens", "Blocks": "2 blocks",
         "Workers": "w0, w1", "Sessions": "1 session"}]
    # B had 64 + 64 (v0, v1 on w2) in the earlier window and nothing once w2 left; A (160 → 160)
    # and C (32 → 64) did not lose.
    assert lost.to_dict("records") == [{"Prefix": "—", "Cached tokens before": "128 tokens",
                                        "Cached tokens after": "0 tokens", "Branch": "1b1b0000"}]
    # New mobile keys in the later window: m0b (continues m0) and m1 → 1 re-key of 2.
    assert rekeyed.to_dict("records") == [{"Segment": "mobile", "Re-keyed sessions": "1 session",
                                           "Share of new keys": "50.0%"}]
    # Pool 4 → 3 when w2 aged out; of u0, u1, v0, v1 (served before and after) v0 and v1 moved: 2 / 4.
    (pool,) = pools.to_dict("records")
    assert (pool["Pool before"], pool["Pool after"], pool["Keys reshuffled"]) == ("4 workers", "3 workers", "50.0%")
    # Relative first, then the 24-hour time in the configured zone, to the second.
    assert re.fullmatch(r"\S.* ago \(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \S+\)|\S.* ago \(\d\d:\d\d:\d\d \S+\)",
                        pool["When"]), pool["When"]
    at.radio(key="tree_by").set_value("blocks").run()
    assert not at.exception


def test_workers_page(exporter_only: str) -> None:
    at = run("workers")
    m = metrics(at)
    assert m["Cache pressure (full and thrashing)"] == "0.0%"  # 4 of 100 blocks: not full
    assert m["Topology-aware placement"] == "—"  # no topology: missing, not 0
    # No scrape targets, but the pool holds both workers the exporter has seen: both up.
    assert (m["Up"], m["Down"], m["Left the pool"], m["Pool size (exporter)"]) == ("2", "0", "0", "2")
    assert worker_tables(at)["liveness"]["Liveness"].tolist() == ["up", "up"]
    ranking = worker_tables(at)["removal_ranking"]
    assert list(ranking["Worker"]) == ["w1", "w0"]  # w1 holds less reused cache: safest to remove
    assert ranking["Used"].tolist() == ["2.0%", "4.0%"]


def test_workers_page_with_a_topology_and_a_pool_change(topology_only: str) -> None:
    """Hand-computed from topology_cluster.py (its docstring lays out every input)."""
    at = run("workers")
    m = metrics(at)
    assert m["Cache pressure (full and thrashing)"] == "0.0%"  # no worker is full (w2: 4 / 400)
    # Placements in the last 5 minutes (best holder's domain vs the chosen worker's): u0, u1
    # (n0-d0 → w0, w1), v1 (w2's n1-d0 → w3), m0b, m1 (w3) hit; v0 (w2's n1-d0 → w0) misses: 5 / 6.
    assert m["Topology-aware placement"] == "83.3%"
    # 2 migrations (v0 hard, v1 soft) in 300 s → 0.4/min; only v0 crossed nodes (n1 → n0) → 0.2/min.
    assert m["Session migrations per minute"] == "0.4/min"
    assert m["Cross-node migrations per minute"] == "0.2/min"
    ranking = worker_tables(at)["removal_ranking"]
    # Effective cache value = resident blocks × 16 × hit ratio of the window's records:
    # w3 2 × 16 × (0 + 32 + 32) / (80 + 112 + 48) = 8.53; w0 5 × 16 × (80 + 32) / (96 + 80) = 50.9;
    # w1 5 × 16 × 80 / 96 = 66.7; w2 served nothing in the window and the pool is 3 of 4: the
    # three that served are the pool, w2 has left it and is not ranked at all.
    assert list(ranking["Worker"]) == ["w3", "w0", "w1"]
    assert ranking["Safe-to-remove rank"].tolist() == ["1", "2", "3"]
    assert ranking["Effective cache value"].tolist() == ["8.53 tokens", "50.9 tokens", "66.7 tokens"]
    assert ranking["Used"].tolist() == ["0.5%", "0.5%", "0.5%"]
    assert ranking["Warm pool"].tolist() == ["yes", "no", "no"]
    assert ranking["Liveness"].tolist() == ["up", "up", "up"]
    assert worker_tables(at)["left_pool"]["Worker"].tolist() == ["w2"]
    assert (m["Up"], m["Left the pool"], m["Pool size (exporter)"]) == ("3", "1", "3")
    domains = worker_tables(at)["domains"]
    assert domains.to_dict("records") == [
        {"NVLink domain": "n0-d0", "Node": "n0", "Workers": "w0, w1", "Resident blocks": "10 blocks"},
        {"NVLink domain": "n1-d0", "Node": "n1", "Workers": "w2, w3", "Resident blocks": "6 blocks"}]


def test_workers_page_tells_dead_workers_from_live_ones(liveness_only: str) -> None:
    """Hand-laid in liveness_cluster.py: w0, w1 up; w3 fails its scrape but serves; w2 left."""
    at = run("workers")
    m = metrics(at)
    assert (m["Up"], m["Down"], m["Left the pool"], m["Pool size (exporter)"]) == ("2", "1", "1", "2")
    table = worker_tables(at)["liveness"]
    assert dict(zip(table["Worker"], table["Liveness"], strict=True)) == {
        "w0": "up", "w1": "up", "w2": "left the pool", "w3": "down"}
    # The exporter ranks w2 (value 16) safest to remove; it is gone, so the console ranks the rest:
    # w0 and w3 (32 each, by name), then w1 (48).
    ranking = worker_tables(at)["removal_ranking"]
    assert ranking[["Safe-to-remove rank", "Worker", "Liveness"]].to_dict("records") == [
        {"Safe-to-remove rank": "1", "Worker": "w0", "Liveness": "up"},
        {"Safe-to-remove rank": "2", "Worker": "w3", "Liveness": "down"},
        {"Safe-to-remove rank": "3", "Worker": "w1", "Liveness": "up"}]
    assert worker_tables(at)["left_pool"]["Worker"].tolist() == ["w2"]


def test_the_workers_page_reads_the_exporters_worker_list(monkeypatch: pytest.MonkeyPatch, liveness_only: str) -> None:
    """With the exporter as the source, liveness, scrape ages, hit shares and KV stream health come
    from /api/v1/workers, not pieced together from /metrics (liveness_cluster.py; clock at 1000)."""
    from console import data

    def no_metrics(_url: str) -> None:
        raise AssertionError("the Workers page read /metrics with the exporter as its source")

    monkeypatch.setattr(data, "pool_view", no_metrics)
    at = run("workers")  # fails on an exception if the page called pool_view
    assert not any("liveness is unknown" in w.value for w in at.warning)
    table = worker_tables(at)["liveness"].set_index("Worker")
    assert table["Liveness"].to_dict() == {"w0": "up", "w1": "up", "w2": "left the pool", "w3": "down"}
    assert table["Last scrape"].to_dict() == {"w0": "10 s ago", "w1": "10 s ago", "w2": "1 m 40 s ago",
                                              "w3": "1 m 40 s ago"}
    assert table["Last KV event"].tolist() == ["1 m ago"] * 4
    # Hit tokens in the window: w0 32 + 32, w1 48, w2 16, w3 32 + 32 of 192.
    assert table["Share of cluster hits"].to_dict() == {"w0": "33.3%", "w1": "25.0%", "w2": "8.3%", "w3": "33.3%"}
    assert table["KV sequence gaps"].tolist() == ["0"] * 4
    ranking = worker_tables(at)["removal_ranking"]
    assert ranking["Worker"].tolist() == ["w0", "w3", "w1"]  # w2 left: not ranked


def test_hot_branches_do_not_name_workers_that_left(liveness_only: str) -> None:
    at = run("prefix_tree")
    hot = at.dataframe[0].value  # hot branches
    # The shared system prompt is in all four caches; w2 has left the pool.
    assert hot.set_index("Branch").loc["51510000", "Workers"] == "w0, w1, w3"


def test_alerts_page_falls_back_to_the_exporters_firing_checks(exporter_only: str) -> None:
    at = run("alerts")
    # the symptom, the cause, and the engines' hit-rate SLO the low hit rate breaks
    assert metrics(at)["Firing alert groups"] == "3"
    body = texts(at)
    assert "### PrefixHitRateLow · warning · step 1 · 1 firing" in body
    assert "### PrefixStickyCollisionsHigh · warning · step 2 · 1 firing" in body
    assert "[runbook](./runbook?alert=PrefixStickyCollisionsHigh)" in body
    assert "Grafana panel" not in body


def test_runbook_page_only_opens_catalogue_alerts(exporter_only: str) -> None:
    at = AppTest.from_file(APP, default_timeout=30)
    at.query_params["alert"] = "../../etc/passwd"
    at.run()
    at.switch_page("app_pages/runbook.py").run()
    assert not at.exception
    assert at.selectbox(key="runbook_alert").value == "PrefixAsyncPrefillBacklog"  # first, not the input


@pytest.mark.parametrize("page", [None, "prefix_tree", "workers", "alerts"])
def test_exporter_down_is_a_message_not_a_stack_trace(monkeypatch: pytest.MonkeyPatch, closed_url: str,
                                                      page: str | None) -> None:
    monkeypatch.setenv(EXPORTER_ENV, closed_url)
    monkeypatch.delenv(PROMETHEUS_ENV, raising=False)
    at = run(page)
    assert any("prefixscope exporter is down or unreachable" in e.value and closed_url in e.value for e in at.error)


def test_prometheus_down_falls_back_to_the_exporter(monkeypatch: pytest.MonkeyPatch, exporter_url: str,
                                                    closed_url: str) -> None:
    monkeypatch.setenv(EXPORTER_ENV, exporter_url)
    monkeypatch.setenv(PROMETHEUS_ENV, closed_url)
    at = run()
    assert any(f"Prometheus at {closed_url} is unavailable" in w.value for w in at.warning)
    assert at.error[0].value.startswith("**FIRING** · Verdict: step 2")



def test_runbook_links_stay_in_the_app(exporter_only: str) -> None:
    from console.links import in_app_markdown

    assert in_app_markdown("see [chain](diagnosis-chain.md), [x](PrefixHitRateLow.md), [y](other.md)") == (
        "see [chain](./diagnosis), [x](./runbook?alert=PrefixHitRateLow), [y](other.md)")
    at = AppTest.from_file(APP, default_timeout=30)
    at.query_params["alert"] = "PrefixHitRateLow"
    at.run()
    at.switch_page("app_pages/runbook.py").run()
    assert "([diagnosis chain](./diagnosis))" in texts(at)
