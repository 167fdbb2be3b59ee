"""The /api/v1 payload shapes of docs/api.md, on a small crafted state."""

import pytest

from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders, ApiError
from prefixscope.thresholds import load_thresholds


def state() -> ClusterState:
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 200.0)
    st.apply_kv_batch(KvBatch("w0", 0, 99.0, (BlockStored((1, 2, 3), None, 16), BlockStored((4,), 2, 16))), 100.0)
    st.ingest_records([{"ts": 101, "request_id": "a", "worker": "w0", "prompt_tokens": 64,
                        "block_hashes": [1, 2, 3, 9], "cached_tokens": 48, "session_key": "s"}], 101)
    st.refresh_tree_stats()  # as the runtime's background refresher does
    return st


def test_tree_groups_hotspots_changes():
    api = ApiBuilders(state()).routes()
    tree = api["tree"]({})
    top = tree["root"]["children"][0]
    assert top["id"] == "0000000000000001" and top["blocks"] == 2 and top["hit_tokens"] == 32
    assert [c["id"][-1] for c in top["children"]] == ["3", "4"]  # by hits: 3 was hit, 4 not
    assert tree["stats"]["nodes"] == 3 and tree["stats"]["root_fanout"] == 1
    hot = api["hotspots"]({"k": "5"})
    assert hot["hot_branches"][0] == {"rank": 1, "branch": "00000000", "hit_tokens": 48.0, "blocks": 1,
                                      "workers": ["w0"], "sessions": 1, "text": None, "token_ids": None,
                                      "tenant": None, "adapter": None}
    assert hot["duplication"]["blocks_on_1"] == 4
    groups = api["groups"]({})
    assert [s["step"] for s in groups["steps"]] == [0, 1, 2, 3, 4, 5]
    assert groups["reuse"]["achieved_tokens"] == 48 and groups["reuse"]["predicted_tokens"] is None
    assert api["changes"]({})["pool_changes"] == []


def test_bad_parameters_raise():
    api = ApiBuilders(state()).routes()
    with pytest.raises(ApiError):
        api["tree"]({"depth": "x"})
    with pytest.raises(ApiError):
        api["changes"]({"from": "10", "to": "5"})


def test_a_shard_names_itself_in_groups_and_workers() -> None:
    whole = ApiBuilders(state()).routes()
    assert whole["groups"]({})["shard"] is None and whole["workers"]({})["shard"] is None
    part = ApiBuilders(state(), shard=(2, 4)).routes()
    assert part["groups"]({})["shard"] == {"index": 2, "count": 4}
    assert part["workers"]({})["shard"] == {"index": 2, "count": 4}
