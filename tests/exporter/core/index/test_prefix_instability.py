"""Prefix instability: new root branches that near-duplicate a recent root, per request.

The pure tracker (what counts as new, as a near-duplicate, what is remembered) and the check
through the exporter's public interfaces: KV batches and records in, /metrics and
/api/v1/groups over HTTP out, with the example pair among the check's culprits.
"""

from __future__ import annotations

import requests
from prometheus_client import CollectorRegistry

from exporter.core.health import Health
from exporter.core.index.prefix_instability import COMPARED_BLOCKS, RootTracker, differing_span
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from exporter.web.collector import PrefixscopeCollector
from exporter.web.exposition import render_state
from exporter.web.server import ExporterServer, ServerDeps
from prefixscope.thresholds import load_thresholds

BS = 16
SYSTEM = [1000 + i % 97 for i in range(COMPARED_BLOCKS * BS * 2)]  # the shared system prompt's tokens


def stamped(t: int) -> list[int]:
    """A prompt whose first block holds a time of day ("08:05:01.123456\\n" as digits), then the system prompt."""
    stamp = [48 + int(c) if c.isdigit() else 58 for c in f"08:{t // 60 % 60:02d}:{t % 60:02d}.{t * 7919 % 10**6:06d}\n"]
    return stamp[:BS] + SYSTEM


def unique(seed: int, n_blocks: int = COMPARED_BLOCKS + 4) -> list[int]:
    return [(seed * 7919 + i * 104729) % 50000 for i in range(n_blocks * BS)]


def root(first: int, tokens: list[int], medium: str | None = "GPU") -> BlockStored:
    n = len(tokens) // BS
    return BlockStored(tuple(range(first, first + n)), None, BS, token_ids=tuple(tokens), medium=medium)


def test_differing_span() -> None:
    assert differing_span([1, 2, 3, 4], [1, 9, 8, 4]) == (1, 2)
    assert differing_span([1, 2, 3], [1, 2, 3]) == (0, 0)
    assert differing_span([5, 2], [6, 2, 7]) == (0, 1)


def test_a_changing_first_block_is_a_near_duplicate_a_new_document_is_not() -> None:
    tr = RootTracker(window_s=300)
    first = tr.apply("w0", [root(10_000, stamped(1))], 1.0)
    assert (first.roots, first.unstable) == (1, 0)  # nothing recent to repeat
    again = tr.apply("w1", [root(20_000, stamped(2))], 2.0)
    assert (again.roots, again.unstable) == (1, 1)
    pair = tr.example
    assert pair is not None and (pair.new_root, pair.recent_root, pair.worker) == (20_000, 10_000, "w1")
    assert 0 < pair.span_length <= BS and pair.span_offset + pair.span_length <= BS  # only the time differs
    docs = tr.apply("w0", [root(30_000 + 100 * i, unique(i)) for i in range(5)], 3.0)
    assert (docs.roots, docs.unstable) == (5, 0)


def test_a_root_seen_within_the_window_is_not_new_and_the_window_forgets() -> None:
    tr = RootTracker(window_s=300)
    tr.apply("w0", [root(10_000, stamped(1))], 1.0)
    tr.apply("w0", [root(20_000, stamped(2))], 2.0)
    # the same prefix stored again elsewhere (a second worker) is not a new root branch
    assert tr.apply("w1", [root(20_000, stamped(2))], 3.0).unstable == 0
    # a twin older than the window is not recent
    assert tr.apply("w0", [root(40_000, stamped(9))], 400.0).unstable == 0


def test_offload_tiers_short_chains_and_missing_tokens_are_not_judged() -> None:
    tr = RootTracker(window_s=300)
    tr.apply("w0", [root(10_000, stamped(1))], 1.0)
    assert tr.apply("w0", [root(20_000, stamped(2), medium="CPU")], 2.0).roots == 0
    no_tokens = BlockStored(tuple(range(30_000, 30_040)), None, BS)
    assert tr.apply("w0", [no_tokens], 3.0).roots == 0
    short = stamped(3)[:4 * BS]  # too short to compare 8 identical blocks after the span
    assert tr.apply("w0", [root(50_000, short)], 4.0).unstable == 0
    assert tr.apply("w0", [BlockStored((7,), 10_000, BS, token_ids=tuple(range(BS)))], 5.0).roots == 0  # not a root


def test_memory_is_bounded() -> None:
    tr = RootTracker(window_s=300, max_roots=8)
    for i in range(50):
        tr.apply("w0", [root(100_000 + 1000 * i, unique(i))], float(i))
    assert len(tr) == 8 and len(tr._by_key) <= 8 * 2


def _fleet_state(stamped_share: int) -> ClusterState:
    """Ten requests a second for a minute; ``stamped_share`` of every ten render the time first."""
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 70.0)
    shared = root(1, SYSTEM[:COMPARED_BLOCKS * BS])
    st.apply_kv_batch(KvBatch("w0", 0, 1.0, (shared,)), 1.0)
    seq = 1
    for t in range(2, 62):
        events = [root((10 * t + i) << 40, stamped(10 * t + i)) for i in range(stamped_share)]
        if events:
            st.apply_kv_batch(KvBatch("w1", seq, float(t), tuple(events)), float(t))
            seq += 1
        st.ingest_records([{"ts": float(t), "request_id": f"r{t}-{i}", "worker": "w0", "prompt_tokens": 640,
                            "block_hashes": [1, 2, 3]} for i in range(10)], float(t))
    return st


def test_the_check_fires_on_a_stamped_prompt_through_metrics_and_the_api() -> None:
    st = _fleet_state(stamped_share=3)
    text = render_state(st).decode()
    assert "prefixscope_prefix_unstable_root_branches_total 179.0" in text  # the first stamped root has no twin
    assert "prefixscope_prefix_root_branches_total 181.0" in text
    reg = CollectorRegistry(auto_describe=False)
    reg.register(PrefixscopeCollector(st))
    srv = ExporterServer("127.0.0.1", 0, ServerDeps(registry=reg, api=ApiBuilders(st).routes())).start()
    try:
        data = requests.get(srv.url + "/api/v1/groups", timeout=5).json()["data"]
    finally:
        srv.stop()
    assert data["signals"]["kv_token_ids"] is True
    step1 = next(s for s in data["steps"] if s["step"] == 1)
    check = next(c for c in step1["checks"] if c["key"] == "prefix_root_instability")
    assert check["status"] == "firing" and abs(check["value"] - 179 / 600) < 1e-9
    assert data["verdict"]["step"] == 1 and data["verdict"]["checks"] == ["prefix_root_instability"]
    (pair,) = check["culprits"]["near_duplicates"]
    assert pair["new_root"] != pair["recent_root"] and 0 < pair["span_offset"] + pair["span_length"] <= BS
    # prefix text is off: where the two differ is shown, never the prompt's tokens
    assert pair["new_token_ids"] is pair["recent_token_ids"] is pair["new_text"] is None
    example = st.kv.roots.example
    assert example is not None
    new, old, off, n = example.new_tokens, example.recent_tokens, example.span_offset, example.span_length
    assert new[:off] == old[:off] and new[off + n:] == old[off + n:] and new[off] != old[off]


def test_stable_prompts_read_zero_and_without_token_ids_the_check_is_not_instrumented() -> None:
    data = ApiBuilders(_fleet_state(stamped_share=0)).routes()["groups"]({})
    check = next(c for s in data["steps"] for c in s["checks"] if c["key"] == "prefix_root_instability")
    assert check["status"] == "ok" and check["value"] == 0.0
    st = ClusterState.build(Health(), load_thresholds(), clock=lambda: 10.0)
    st.apply_kv_batch(KvBatch("w0", 0, 1.0, (BlockStored((1, 2), None, BS),)), 1.0)
    st.ingest_records([{"ts": 2.0, "request_id": "a", "worker": "w0", "prompt_tokens": 32, "block_hashes": [1, 2]}], 2.0)
    data = ApiBuilders(st).routes()["groups"]({})
    check = next(c for s in data["steps"] for c in s["checks"] if c["key"] == "prefix_root_instability")
    assert check["status"] == "not_instrumented" and check["missing_signals"] == ["kv_token_ids"]


def test_the_compiled_token_check_is_the_python_one() -> None:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from exporter.core.index.prefix_instability import _ints_only, _ints_only_py

    class Sub(int):
        pass

    items = st.one_of(st.integers(-(2**70), 2**70), st.booleans(), st.floats(allow_nan=False), st.text(max_size=2),
                      st.integers(0, 9).map(Sub))

    @settings(max_examples=200, deadline=None)
    @given(st.lists(items, max_size=40).map(tuple))
    def check(tokens: tuple) -> None:
        assert _ints_only(tokens) == _ints_only_py(tokens)

    check()


def test_scanned_batches_are_judged_as_their_events_are() -> None:
    """The state reads a scanned batch's roots as keys the compiled reader computed from the payload
    (``KvScan.root_keys``); the same stream as event objects leaves the same tracker and series."""
    import msgpack

    from exporter.codecs import kvcodec

    def payload(ts: float, events: list[BlockStored]) -> bytes:
        return msgpack.packb([ts, [{"type": "BlockStored", "block_hashes": list(ev.hashes), "parent_block_hash": None,
                                    "token_ids": list(ev.token_ids), "block_size": ev.block_size,
                                    "medium": ev.medium} for ev in events], 0])

    stream = [(1.0, "w0", [root(1, SYSTEM[:COMPARED_BLOCKS * BS])])]
    stream += [(float(t), f"w{t % 3}", [root((10 * t + i) << 40, stamped(10 * t + i)) for i in range(3)]
                + [root((7 * t) << 44, unique(t)), root((9 * t) << 44, stamped(t)[: 5 * BS], medium="CPU")])
               for t in range(2, 40)]
    scanned, plain = (ClusterState.build(Health(), load_thresholds(), clock=lambda: 50.0) for _ in range(2))
    for seq, (ts, worker, events) in enumerate(stream):
        batch = kvcodec.decode_batch(payload(ts, events), worker, seq)
        assert batch is not None
        scanned.apply_kv_batch(batch, ts)
        plain.apply_kv_batch(KvBatch(worker, seq, ts, tuple(events)), ts)
    a, b = scanned.kv.roots, plain.kv.roots
    assert a.example is not None and a.example == b.example
    assert a._roots == b._roots and a._by_key == b._by_key and a.tokens_seen == b.tokens_seen
    assert render_state(scanned).decode().count("root_branches") > 0
    assert [line for line in render_state(scanned).decode().splitlines() if "root_branches" in line] == \
        [line for line in render_state(plain).decode().splitlines() if "root_branches" in line]


def test_roots_given_as_keys_are_judged_as_their_events_are() -> None:
    """``apply_keyed`` (the per-batch path, fed ``root_key`` of each root) leaves the tracker and
    counts of ``apply`` on the events, whatever the mix of repeats, twins, short and token-less roots."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from exporter.core.index.eviction import is_gpu
    from exporter.core.index.prefix_instability import root_key

    prompts = [stamped(t) for t in range(4)] + [unique(i) for i in range(2)] + [SYSTEM[: 12 * BS], SYSTEM[: 3 * BS], []]
    event = st.builds(lambda first, prompt, medium, cut: root(first, prompts[prompt][: cut * BS] if cut else
                                                              prompts[prompt], medium),
                      st.integers(1, 12).map(lambda i: i << 40), st.integers(0, len(prompts) - 1),
                      st.sampled_from(["GPU", "GPU", None, "CPU"]), st.integers(0, COMPARED_BLOCKS + 2))

    @settings(max_examples=150, deadline=None)
    @given(st.lists(st.tuples(st.lists(event, max_size=4), st.sampled_from([0.5, 3.0, 40.0])), max_size=12),
           st.integers(2, 6))
    def check(batches: list, max_roots: int) -> None:
        a, b = RootTracker(window_s=30, max_roots=max_roots), RootTracker(window_s=30, max_roots=max_roots)
        ts = 100.0
        for events, step in batches:
            ts += step
            got = a.apply("w", events, ts)
            keyed = b.apply_keyed("w", [root_key(ev) for ev in events if ev.hashes and is_gpu(ev.medium)], ts)
            assert (got.roots, got.unstable) == (keyed.roots, keyed.unstable)
            assert a._roots == b._roots and a._by_key == b._by_key
            assert (a.example, a.tokens_seen) == (b.example, b.tokens_seen)

    check()
