"""Every KV sink answers every call its subscriber makes: the ZMQ and NATS subscribers call a
``KvSink``; the relay, which forwards payloads and keeps no view, hands its subscriber a
``KvStreamSink`` and stubs nothing."""

from __future__ import annotations

from typing import Protocol

from exporter.core.health import Health
from exporter.core.prefix_text import PrefixTokens, TokenTee
from exporter.core.sharding import ShardSink
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch, KvSink, KvStreamSink
from exporter.relay import _Restarts
from prefixscope.thresholds import load_thresholds


def _calls(protocol: type[Protocol]) -> set[str]:  # type: ignore[valid-type]
    return {n for c in protocol.__mro__ if c not in (Protocol, object) for n in vars(c)
            if not n.startswith("_")}


def test_every_sink_has_every_call_of_its_protocol() -> None:
    assert _calls(KvSink) == {"apply_kv_batch", "worker_restarted", "reset_view", "view_repaired"}
    for sink in (ClusterState, TokenTee, ShardSink):
        assert all(callable(getattr(sink, n, None)) for n in _calls(KvSink)), sink
    assert _calls(KvStreamSink) <= set(vars(_Restarts)) and not hasattr(_Restarts, "apply_kv_batch")


def test_a_rebuild_through_the_prefix_text_tee_reaches_the_state() -> None:
    st = ClusterState.build(Health(), load_thresholds())
    tee = TokenTee(st, PrefixTokens())
    tee.apply_kv_batch(KvBatch("w0", 0, 1.0, (BlockStored((1, 2), None, 16),)), 1.0)
    assert st.index.resident_blocks("w0") == 2
    tee.reset_view("w0")
    assert not st.index.resident_blocks("w0")
    tee.view_repaired("w0", "over_capacity", False)
    assert st.kv.unreliable_views() == ["w0"]
