"""A state fed the compiled reader's scans reads the same as one fed the decoded events.

``ClusterState.apply_kv_batch`` applies a batch the compiled reader scanned (``ScannedBatch``)
from its C arrays; the same batch as plain events (what the typed path decodes, root tokens
included) must leave every series, window, health counter and view the same.
"""

from __future__ import annotations

import msgpack
import pytest

from bench.ingest import payloads
from exporter.codecs import kvcodec
from exporter.core.health import Health
from exporter.core.state import ClusterState
from exporter.model import KvBatch
from prefixscope.thresholds import load_thresholds

pytest.importorskip("exporter.core.index._prefix_core")


def _state() -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), window_s=30, clock=lambda: 0.0)


def _read(st: ClusterState) -> dict:
    store = st.store
    return {
        "cum": (store.cum.counters, store.cum.histograms), "win": store.win.sums,
        "hwin": {m: hw.counts for m, hw in store.hwin.items()},
        "health": st.health.snapshot(), "resident": st.index.resident_by_worker(), "len": len(st.index),
        "tracked": [st.kv.evictions.tracked(w) for w in ("w0", "w1")], "roots": len(st.kv.roots),
        "example": st.kv.roots.example, "block_size": {w: i.block_size for w, i in st.worker_pool.workers.items()},
        "signals": st.signals(), "series": st.series(),
    }


def _more() -> list[bytes]:
    """Batches the benchmark stream lacks: other media, a clear, unknown parents, array encoding."""
    stored = {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": 99, "block_size": 16,
              "token_ids": list(range(32)), "medium": "CPU"}
    return [msgpack.packb([2e9, [stored, {"type": "BlockRemoved", "block_hashes": [11, 5], "medium": "CPU"}], 0]),
            msgpack.packb([2e9 + 1, [["BlockStored", [21, 22], None, list(range(32)), 16, None, "GPU"],
                                     ["BlockRemoved", [21]], ["AllBlocksCleared"]], None])]


def test_scanned_batches_leave_the_state_as_their_events_do() -> None:
    data, _ = payloads(n_batches=600, capacity=500)
    data += _more()
    scanned, plain = _state(), _state()
    for seq, payload in enumerate(data):
        worker = f"w{seq % 2}"
        batch = kvcodec.decode_batch(payload, worker, seq)
        assert type(batch) is kvcodec.ScannedBatch
        typed = kvcodec._typed(payload, worker, seq, False)
        received = batch.ts + (seq // 200) * 40.0 + (seq % 3) * 0.5  # windows expire on the way
        scanned.apply_kv_batch(batch, received)
        plain.apply_kv_batch(KvBatch(typed.worker, typed.seq, typed.ts, typed.events, typed.dp_rank), received)
        if seq % 97 == 0:
            assert _read(scanned) == _read(plain)
    assert _read(scanned) == _read(plain)
    assert scanned.store.window_buckets("prefixscope_kv_block_eviction_age_seconds") is not None and len(scanned.kv.roots)
