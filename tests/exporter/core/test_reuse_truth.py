"""The reuse decomposition keeps achieved ≤ available ≤ prompt, what-if capacity is KV tokens
whatever the trace's block size, and MoE alignment follows a prefix's recent majority signature."""

from __future__ import annotations

import pytest

import lab.replay as rp
from exporter.core.block_tokens import blocks_of, tokens_of
from exporter.core.checks import evaluate
from exporter.core.health import Health
from exporter.core.moe_alignment import ExpertSignatures, majority
from exporter.core.state import ClusterState
from exporter.model import BlockStored, KvBatch
from fleet.simulation import with_block_size
from fleet.topology import load_topology
from prefixscope.thresholds import load_thresholds
from tests.shared_data import MOONCAKE, require


def _state() -> ClusterState:
    return ClusterState.build(Health(), load_thresholds(), window_s=300)


def _reuse(st: ClusterState, now: float) -> dict[str, float | None]:
    return evaluate(st, now=now).reuse


def _assert_ordered(reuse: dict[str, float | None]) -> None:
    achieved, available, prompt = reuse["achieved_tokens"], reuse["available_tokens"], reuse["prompt_tokens"]
    assert achieved is not None and available is not None and prompt is not None, reuse
    assert achieved <= available <= prompt, reuse


# ---- one block rule ----------------------------------------------------------------------------
def test_block_rule_counts_a_partial_last_block_with_its_own_size() -> None:
    # 1300 tokens in blocks of 512: 512 + 512 + 276
    assert [tokens_of(d, 1300, 512) for d in range(5)] == [0, 512, 1024, 1300, 1300]
    assert [blocks_of(t, 1300, 3, 512) for t in (0, 511, 512, 1299, 1300)] == [0, 0, 1, 2, 3]


def test_a_whole_prompt_reused_with_a_partial_last_block_was_available() -> None:
    """Before: the engine's 1300 reused tokens were available as 2 whole blocks (1024): achieved > available."""
    st = _state()
    st.ingest_records([{"ts": 10.0, "request_id": "r", "worker": "w0", "prompt_tokens": 1300, "block_size": 512,
                        "block_hashes": [1, 2, 3], "cached_tokens": 1300}], 10.0)
    reuse = _reuse(st, 10.0)
    assert (reuse["achieved_tokens"], reuse["available_tokens"], reuse["prompt_tokens"]) == (1300, 1300, 1300)


def test_available_is_the_deepest_worker_in_tokens_capped_by_the_prompt() -> None:
    st = _state()
    st.apply_kv_batch(KvBatch("w1", 0, 5.0, (BlockStored((1, 2, 3), None, 512),)), 5.0)
    st.ingest_records([{"ts": 10.0, "request_id": "r", "worker": "w0", "prompt_tokens": 1300, "block_size": 512,
                        "block_hashes": [1, 2, 3], "cached_tokens": 600}], 10.0)
    reuse = _reuse(st, 10.0)
    assert (reuse["achieved_tokens"], reuse["available_tokens"]) == (600, 1300)  # w1 holds all three blocks
    _assert_ordered(reuse)


@pytest.mark.parametrize("policy", ["round-robin", "prefix-tree"])
def test_mooncake_replay_keeps_achieved_within_available_within_prompt(policy: str) -> None:
    trace = rp.load_trace(require(MOONCAKE))
    trace.requests = trace.requests[:1200]
    _assert_ordered(rp.replay(trace, 8, policy)["reuse"])


# ---- what-if capacity in tokens ---------------------------------------------------------------
def test_trace_blocks_hold_the_topologys_kv_tokens() -> None:
    base = load_topology()
    topo = rp.build_topology(base, 8, 512, None)
    for w, b in zip(topo.workers, base.workers, strict=True):
        assert w.kv_blocks * 512 == b.kv_blocks * base.block_size  # 64,000 × 16 = 2,000 × 512
    assert rp.build_topology(base, 8, 512, 300).workers[0].kv_blocks == 300  # the flag is in trace blocks
    assert with_block_size(base, base.block_size) is base


def test_mooncake_replay_models_the_topologys_capacity_not_32_times_it() -> None:
    trace = rp.load_trace(require(MOONCAKE))
    trace.requests = trace.requests[:1200]
    base = load_topology()
    result = rp.replay(trace, 8, "round-robin")
    assert result["replay"]["capacity_blocks"]["w0"] == base.workers[0].kv_blocks * base.block_size // 512
    # 1,200 Mooncake requests (~14 M prompt tokens) fill a worker's 1 M tokens of KV cache
    assert result["replay"]["max_cache_fill_ratio"] > 0.9


# ---- MoE alignment recovers after an intended gating change -------------------------------------
def test_recent_majority_keeps_the_incumbent_on_a_tie_and_ignores_random_misrouting() -> None:
    assert majority(("a", "a", "b", "b"), "a") == "a"
    assert majority(("a", "b", "b", "b"), "a") == "b"
    sigs = ExpertSignatures(recent=8)
    for i in range(100):
        sigs.observe(7, f"odd{i}" if i % 2 else "base")  # half the hits misrouted, each differently
        assert sigs.expected(7) == "base"


def test_signature_memory_is_bounded() -> None:
    sigs = ExpertSignatures(recent=4, max_prefixes=10)
    for p in range(100):
        for _ in range(6):
            sigs.observe(p, "s")
    assert len(sigs) == 10 and sigs.expected(99) == "s" and sigs.expected(0) is None


def test_moe_alignment_recovers_after_an_intended_gating_change() -> None:
    """Before: every hit after the change was compared with the first signature ever seen, forever."""
    st = _state()

    def hits(t0: float, n: int, sig: str) -> None:
        st.ingest_records([{"ts": t0 + i, "request_id": f"{sig}{t0 + i}", "worker": "w0", "prompt_tokens": 32,
                            "block_hashes": [1, 2], "cached_tokens": 32, "expert_signature": sig}
                           for i in range(n)], t0 + n)

    hits(0.0, 50, "old")
    assert evaluate(st, now=50).results["moe_expert_alignment_rate"].value == 1.0
    hits(1000.0, 50, "new")  # the new gating checkpoint, deployed on purpose
    rate = evaluate(st, now=1050).results["moe_expert_alignment_rate"]
    assert rate.value > 0.85 and rate.status == "ok"  # a handful of hits until "new" is the majority
    hits(2000.0, 50, "new")
    assert evaluate(st, now=2050).results["moe_expert_alignment_rate"].value == 1.0
