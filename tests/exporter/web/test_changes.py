"""/api/v1/changes on real history: two 300 s windows of hits, sessions and a pool change.

Window A (−100, 200] and window B (200, 500]. The cluster tree (all on w0): the system prompt
[S1, S2] branching into X = [X1, X2, X3] and Y = [Y1, Y2]. Hits are attributed to the branch
below the first branching block; a hit that stops inside the system prompt belongs to the
system prompt's own branch (its first block, S1).
"""

from exporter.core.health import Health
from exporter.core.state import ClusterState, branch_label
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders, ApiError
from prefixscope.thresholds import load_thresholds


def h(n: int) -> int:
    """A 64-bit hash whose first 8 hex digits (the /metrics branch label) differ per n."""
    return (n << 56) | n


S1, S2, X1, X2, X3, Y1, Y2, Z1 = (h(n) for n in range(1, 9))
X = [S1, S2, X1, X2, X3]
Y = [S1, S2, Y1, Y2]


def rec(ts, rid, worker, prompt, **kw):
    return {"ts": ts, "request_id": rid, "worker": worker, "prompt_tokens": prompt, **kw}


def history() -> ClusterState:
    st = ClusterState.build(Health(), load_thresholds(), window_s=300)
    st.apply_kv_batch(KvBatch("w0", 0, 95.0, (BlockStored((S1, S2, X1, X2, X3), None, 16),
                                             BlockStored((Y1, Y2), S2, 16))), 95.0)
    # window A, on w0 and w1; both are found within the first minute (discovery, not a pool change)
    st.ingest_records([
        rec(100, "a1", "w0", 80, block_hashes=X, cached_tokens=80),  # X: 80 tokens (5 blocks)
        rec(110, "a2", "w1", 80, block_hashes=X, cached_tokens=48),  # X: 48 (S1, S2, X1)
    ], 110)
    st.ingest_records([
        rec(160, "a3", "w0", 64, block_hashes=Y, cached_tokens=64),  # Y: 64
        rec(190, "a4", "w1", 48, block_hashes=[S1, S2, Z1], cached_tokens=32),  # system prompt only: S1, 32
    ], 190)
    st.ingest_records([  # window B, on w0 only (w1 left)
        rec(400, "b1", "w0", 80, block_hashes=X, cached_tokens=48),  # X: 48
        rec(410, "b2", "w0", 64, block_hashes=Y, cached_tokens=64),  # Y: 64, as before
        # sessions (no cached tokens reported as hits): web opens a, b and c, where c is a
        # re-keyed continuation of a; mobile opens m
        rec(420, "s1", "w0", 48, session_key="a", segment="web", block_hashes=[S1, S2, X1], cached_tokens=0),
        rec(421, "s2", "w0", 48, session_key="b", segment="web", block_hashes=[S1, S2, Y1], cached_tokens=0),
        rec(422, "s3", "w0", 64, session_key="c", segment="web", block_hashes=[S1, S2, X1, X2],
            cached_tokens=0),
        rec(423, "s4", "w0", 48, session_key="m", segment="mobile", block_hashes=[S1, S2, Z1], cached_tokens=0),
        rec(500, "b3", "w0", 16, cached_tokens=0),
    ], 500)
    st.refresh_tree_stats()  # branches are read against the latest statistics pass
    return st


# Without prefix text and attribution a lost branch is named by its hash alone.
UNNAMED = {"text": None, "token_ids": None, "tenant": None, "adapter": None}


def test_default_windows_compare_the_previous_window_with_the_current_one():
    data = ApiBuilders(history()).routes()["changes"]({})
    assert (data["from"], data["to"]) == (200.0, 500.0)
    # X lost 128 − 48 = 80 tokens, the system prompt's own branch 32 − 0; Y kept its 64
    assert data["lost_hits"] == [
        {"branch": branch_label(X1), "before_hit_tokens": 128.0, "after_hit_tokens": 48.0, **UNNAMED},
        {"branch": branch_label(S1), "before_hit_tokens": 32.0, "after_hit_tokens": 0.0, **UNNAMED},
    ]
    # web: 3 new keys, 1 of them a re-key (c continues a); mobile has none and is not listed
    assert data["rekeyed_segments"] == [{"segment": "web", "rekeys": 1, "share": 1 / 3}]
    # w0 and w1 were both seen in window A; at the end of window B's batch w1 has been silent
    # for more than a minute, so only w0 is left
    assert data["pool_changes"] == [{"ts": 500.0, "before": 2, "after": 1, "reshuffled_share": None}]


def test_explicit_windows():
    api = ApiBuilders(history()).routes()["changes"]
    # before (−300, 0] had nothing; after (0, 300] is window A: nothing can have lost hits
    early = api({"from": "0", "to": "300"})
    assert early["lost_hits"] == [] and early["rekeyed_segments"] == []
    assert early["pool_changes"] == []  # the change at 500 is after "to"
    # from = to: the same window on both sides — nothing lost
    assert api({"from": "500", "to": "500"})["lost_hits"] == []
    # only "to" given: "from" defaults to one window earlier
    assert api({"to": "500"})["from"] == 200.0


def test_lost_hits_are_ordered_by_the_size_of_the_loss():
    data = ApiBuilders(history()).routes()["changes"]({"from": "200", "to": "500"})
    losses = [x["after_hit_tokens"] - x["before_hit_tokens"] for x in data["lost_hits"]]
    assert losses == sorted(losses) == [-80.0, -32.0]


def test_bad_windows_are_rejected():
    api = ApiBuilders(history()).routes()["changes"]
    for query in ({"from": "x"}, {"to": "soon"}, {"from": "600", "to": "500"}):
        try:
            api(query)
        except ApiError as exc:
            assert str(exc)
        else:
            raise AssertionError(f"{query} was accepted")
