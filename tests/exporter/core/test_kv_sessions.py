"""vLLM's newer KV-event fields in the state: a store's ``session_id`` is a session key (step 2 with
no record and no span), a ``REMOTE`` block is no GPU residency. Frames as vLLM 0.33's own classes
encode them (tests/fixtures/vllm_kv_events_0_33.py, which names the source and commit)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from exporter.codecs import kvcodec
from exporter.core import checks
from exporter.core.health import Health
from exporter.core.state import ClusterState
from prefixscope.records import RequestRecord
from prefixscope.thresholds import load_thresholds
from tests.fixtures.vllm_kv_events_0_33 import vllm_classes

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TOKENS = list(range(16))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _state() -> tuple[ClusterState, Clock]:
    clock = Clock()
    return ClusterState.build(Health(), load_thresholds(), clock=clock), clock


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_fixture_frames_read_alike_and_a_remote_block_is_no_gpu_residency(encoding: str) -> None:
    payload = (FIXTURES / f"kv_vllm_0_33_{encoding}.msgpack").read_bytes()
    batch = kvcodec.decode_batch(payload, "w0", 0)
    assert batch == kvcodec.decode_careful(payload, "w0", 0) == kvcodec._typed(payload, "w0", 0, False)
    assert [e.medium for e in batch.events] == ["GPU", "GPU", "EXTERNAL", "EXTERNAL", "GPU"]
    assert batch.sessions == (("chat-7", None, 12, "GPU"), ("chat-7", 12, 13, "GPU"))
    st, clock = _state()
    stored, _ = vllm_classes(encoding == "array")[1:3]
    remote = msgspec.msgpack.encode(vllm_classes()[0](1789100001.0, [
        stored([41, 42], None, TOKENS * 2, 16, None, "GPU", None, locality="REMOTE")], 0))
    for seq, frame in enumerate((payload, remote)):
        decoded = kvcodec.decode_batch(frame, "w0", seq, st.health)
        assert decoded is not None
        st.apply_kv_batch(decoded, clock.now)
    g = st.series().gauges
    assert g["prefixscope_worker_resident_blocks"] == {("w0",): 4}  # 11, 12, 13, 31: the remote ones are not the GPU's
    assert g["prefixscope_worker_medium_resident_blocks"] == {("w0", "GPU"): 4, ("w0", "EXTERNAL"): 2}


def _frame(seq: float, *events: object, array_like: bool = False) -> bytes:
    return msgspec.msgpack.encode(vllm_classes(array_like)[0](seq, list(events), 0))


def _store(hashes: list[int], parent: int | None, session: str | None, medium: str = "GPU",
           array_like: bool = False) -> object:
    stored = vllm_classes(array_like)[1]
    return stored(hashes, parent, TOKENS * len(hashes), 16, None, medium, None, session_id=session)


def _counter(st: ClusterState, name: str) -> float:
    return sum(st.series().counters.get(name, {}).values())


@pytest.mark.parametrize("array_like", [False, True])
def test_session_turns_from_kv_events_alone_light_sticky_collisions(array_like: bool) -> None:
    st, clock = _state()
    seq = 0

    def apply(worker: str, at: float, *events: object) -> None:
        nonlocal seq
        clock.now = at
        batch = kvcodec.decode_batch(_frame(at, *events, array_like=array_like), worker, seq, st.health)
        seq += 1
        assert batch is not None and batch.sessions
        st.apply_kv_batch(batch, at)

    assert not st.signals()["affinity_outcomes"]
    apply("w0", 100.0, _store([1, 2], None, "s1", array_like=array_like))  # turn 1 on w0
    apply("w0", 100.5, _store([3], 2, "s1", array_like=array_like))  # its decode block: the same turn
    apply("w1", 100.6, _store([9], None, "s9", array_like=array_like))  # another session keeps w1 alive
    apply("w0", 110.0, _store([4], 3, "s1", array_like=array_like))  # the next turn, on the same worker
    apply("w1", 111.0, _store([5], 4, "s1", array_like=array_like))  # the next, elsewhere: w0 is healthy
    apply("w1", 111.5, _store([6], 5, "s1", array_like=array_like), _store([7], None, "s1", "CPU", array_like))
    assert _counter(st, "prefixscope_followup_requests") == 2
    assert _counter(st, "prefixscope_sticky_collisions") == 1
    assert st.signals()["affinity_outcomes"] and st.signals()["migrations"]
    assert st.sessions.get("s1").turn == 3 and st.sessions.get("s1").worker == "w1"
    result = checks.evaluate(st).results["sticky_session_collision_rate"]
    assert result.value == pytest.approx(0.5)


def test_record_session_keys_take_precedence_over_kv_turns() -> None:
    st, clock = _state()
    st.ingest_records([RequestRecord(request_id="r1", ts=100.0, worker="w0", prompt_tokens=32, session_key="s1")], 100.0)
    clock.now = 101.0
    batch = kvcodec.decode_batch(_frame(101.0, _store([1, 2], None, "s2")), "w0", 0, st.health)
    st.apply_kv_batch(batch, 101.0)
    assert st.sessions.get("s2") is None  # the records count each turn once: the stores add none


def test_a_batch_without_sessions_carries_none() -> None:
    payload = _frame(1.0, _store([1, 2], None, None), _store([3], 2, None))
    batch = kvcodec.decode_batch(payload, "w0", 0)
    assert batch.sessions is None and kvcodec.decode_careful(payload, "w0", 0).sessions is None
