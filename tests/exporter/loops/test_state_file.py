"""The state file: "what changed" and the names of prefixes outlive an exporter restart.

A real exporter (``Runtime``) with ``state_file`` set takes hits and new sessions through its
record intake, then stops (writing the file); a second one started on the same file answers
``/api/v1/changes`` as the first did once the workers' KV events are back in its index (as their
replay brings them), and names the same prefixes. The file is bounded and a bad one is ignored.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import requests

from exporter.config import Config
from exporter.core.hotspots import Hotspots
from exporter.core.index.prefix_index import PrefixIndex
from exporter.core.prefix_text import PrefixTokens
from exporter.loops.state_file import FORMAT, StateFile
from exporter.main import Runtime
from exporter.model import BlockStored, KvBatch

CHAIN = [11, 12, 13, 14]
TEXT_KEY = 4242


def _runtime(path: Path) -> Runtime:
    return Runtime.build(Config(listen_address="127.0.0.1:0", state_file=path, state_interval=3600.0,
                                prefix_text=True)).start()


def _kv(runtime: Runtime, at: float) -> None:
    batch = KvBatch("w0", 0, at, (BlockStored(tuple(CHAIN), None, 16, token_ids=tuple(range(64))),))
    runtime.names.tokens.observe(batch.events)
    runtime.state.apply_kv_batch(batch, at)


def _changes(runtime: Runtime, frm: float, to: float) -> dict:
    body = requests.get(f"{runtime.url}/api/v1/changes", params={"from": frm, "to": to}, timeout=5).json()
    return body["data"]


def test_changes_and_prefix_names_outlive_a_restart(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    now = time.time()
    first = _runtime(path)
    try:
        _kv(first, now - 200)
        turns = [{"ts": now - 190 + i, "request_id": f"a{i}", "worker": "w0", "model": "m", "prompt_tokens": 64,
                  "session_key": f"s{i}", "block_hashes": CHAIN, "cached_tokens": 64} for i in range(10)]
        again = [{"ts": now - 150 + i, "request_id": f"b{i}", "worker": "w0", "model": "m", "prompt_tokens": 64,
                  "session_key": f"s{i}", "block_hashes": CHAIN, "cached_tokens": 64} for i in range(10)]
        first.state.ingest_records(turns, now - 180)
        first.state.ingest_records(again, now - 140)
        first.names.detokenizer.restore([[TEXT_KEY, "You are a support agent for Acme billing"]])
        before = _changes(first, now - 100, now + 200)
        assert before["lost_hits"], before  # the chain's hits fell to none in the later window
    finally:
        first.stop()
    saved = json.loads(path.read_text(encoding="utf-8"))
    assert saved["format"] == FORMAT and len(saved["history"]["hits"]) == 20

    second = _runtime(path)
    try:
        _kv(second, now - 200)  # the worker's KV replay rebuilds the index
        assert second.names.detokenizer.text(TEXT_KEY) == "You are a support agent for Acme billing"
        assert second.names.tokens.get(CHAIN[0]) == tuple(range(16))
        assert _changes(second, now - 100, now + 200) == before
    finally:
        second.stop()


def test_the_saved_history_is_bounded_and_keeps_the_newest() -> None:
    spots = Hotspots(PrefixIndex())
    for i in range(100):
        spots.hit(float(i), [i, i + 1], 2, 32.0, f"s{i}")
        spots.new_session(float(i), "seg", i % 2 == 0)
    saved = spots.saved(max_hits=10, max_chains=5, max_sessions=7)
    assert [h[0] for h in saved["hits"]] == [95.0, 96.0, 97.0, 98.0, 99.0]  # five chains' worth
    assert len(saved["chains"]) == 5 and [s[0] for s in saved["sessions"]] == [93.0 + i for i in range(7)]
    again = Hotspots(PrefixIndex())
    assert again.restore(saved, now=100.0) == 0
    assert [(ts, tok, s) for ts, _c, tok, s in again.hit_events] == [(95.0 + i, 32.0, f"s{95 + i}") for i in range(5)]


def test_a_bad_file_is_ignored_and_malformed_entries_are_left_out(tmp_path: Path) -> None:
    from exporter.bootstrap import bootstrap
    state = bootstrap().state
    path = tmp_path / "state.json"
    path.write_text("{not json", encoding="utf-8")
    assert StateFile(path, state).load() is False
    path.write_text(json.dumps({"format": "something else"}), encoding="utf-8")
    assert StateFile(path, state).load() is False
    assert StateFile(tmp_path / "missing.json", state).load() is False
    history = {"chains": [[1, 2], "x"], "hits": [[time.time(), 0, 16.0, None], [1, 1, 2, None], ["t", 0, 1, None]],
               "sessions": [[time.time(), "seg", True], [1, 2]]}
    f = StateFile(path, state)
    assert f.restore({"format": FORMAT, "history": history, "pool_changes": [[1.0, 2, 3, 0, 0], "x"]}) == 5
    assert len(state.hotspots.hit_events) == 1 and len(state.hotspots.session_events) == 1
    tokens = PrefixTokens(max_kept=2)
    assert tokens.restore([[1, [5, 6]], [2, [7]], [3, [8]], ["x", []]]) == 1
    assert len(tokens) == 2 and tokens.get(1) is None and tokens.get(3) == (8,)
