"""``prefixscope replay``: hand-computed small traces, then the Mooncake trace's published figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleet.traces import load_mooncake, parse_mooncake, replay_requests
from lab import replay as rp
from tests.shared_data import MOONCAKE, require


def mooncake_lines(*rows: tuple[int, int, list[int]]) -> list[str]:
    return [json.dumps({"timestamp": ts, "input_length": n, "output_length": 1, "hash_ids": ids}) for ts, n, ids in rows]


# Block size 4. Hits by the rule "a block is hit when it and all before it are resident":
#   r1 [1,2,3] 10 tokens (4+4+2): nothing cached yet            → 0
#   r2 [1,2,3] 10 tokens: all three resident, the partial counts → 10
#   r3 [1,5]    7 tokens: block 1                                → 4
#   r4 [1,2,6] 12 tokens: blocks 1, 2                            → 8
SMALL = mooncake_lines((0, 10, [1, 2, 3]), (0, 10, [1, 2, 3]), (1000, 7, [1, 5]), (1000, 12, [1, 2, 6]))


def test_small_trace_sequential_hit_tokens_by_hand() -> None:
    trace = rp.parse_trace(SMALL, block_size=4)
    assert [r.line for r in trace.requests] == [1, 2, 3, 4]  # ties keep file order
    result = rp.replay(trace, workers=1, policy="round-robin", capacity_blocks=100)
    assert result["replay"]["hit_tokens"] == 22 and result["replay"]["prompt_tokens"] == 39
    assert result["prefix_hit_rate_total"] == pytest.approx(22 / 39)
    assert result["prefix_hit_rate_per_session"] is None  # Mooncake carries no session ids
    assert result["status"]["prefix_hit_rate_per_session"] == "not_instrumented"
    assert result["moe_expert_alignment_rate"] is None and result["speculative_decoding_acceptance_rate"] is None
    assert set(result) >= {c.key for c in rp.catalog.CHECKS if c.kind == "checklist" and c.group >= 1}


def test_small_trace_timed_requests_in_flight_together_share_nothing() -> None:
    trace = rp.parse_trace(SMALL, block_size=4)
    result = rp.replay(trace, workers=1, policy="round-robin", capacity_blocks=100, timed=True)
    # r1 and r2 arrive together: r2 cannot reuse r1's blocks; r3 and r4 come a second later.
    assert result["replay"]["hit_tokens"] == 0 + 0 + 4 + 8
    assert result["replay"]["mode"] == "timed"


def test_small_trace_eviction_with_a_tiny_cache() -> None:
    # r5 repeats r1 after r3 and r4 pushed block 3 out of a 4-block cache (each request also
    # holds one block for its decode): only blocks 1 and 2 are still there.
    trace = rp.parse_trace([*SMALL, *mooncake_lines((2000, 10, [1, 2, 3]))], block_size=4)
    roomy = rp.replay(trace, workers=1, policy="round-robin", capacity_blocks=100)
    tight = rp.replay(trace, workers=1, policy="round-robin", capacity_blocks=4)
    assert roomy["replay"]["hit_tokens"] == 22 + 10
    assert tight["replay"]["hit_tokens"] == 22 + 8
    # 1, 2, 3 resident at the end: 3/4 of the capacity is not full, so r5 storing block 3 again
    # (evicted before) is not cache pressure
    assert tight["prefix_block_count_per_worker"] == 0.0


def test_records_trace_feeds_session_hit_rate() -> None:
    recs = [
        {"ts": 10.0, "request_id": "a1", "worker": "x", "prompt_tokens": 8, "block_hashes": [1, 2], "block_size": 4,
         "session_key": "s"},
        {"ts": 11.0, "request_id": "a2", "worker": "x", "prompt_tokens": 12, "block_hashes": [1, 2, 3], "block_size": 4,
         "session_key": "s"},
        {"ts": 12.0, "request_id": "bad"},  # fails the schema: skipped and counted
        "not json",
    ]
    lines = [r if isinstance(r, str) else json.dumps(r) for r in recs]
    trace = rp.parse_trace(lines)
    assert (trace.format, len(trace.requests), trace.skipped) == ("records", 2, 2)
    assert trace.first_error is not None and trace.first_error.startswith("line 3:")
    result = rp.replay(trace, workers=2, policy="prefix-tree", capacity_blocks=100)
    assert result["replay"]["hit_tokens"] == 8
    assert result["prefix_hit_rate_per_session"] == pytest.approx(8 / 12)
    assert result["sticky_session_collision_rate"] == 0.0


def test_cli_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n[]\n")
    assert rp.main([str(bad), "--json"]) == 2
    assert "no valid request in the trace" in capsys.readouterr().err
    assert rp.main([str(tmp_path / "absent.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
    assert rp.main([str(bad), "--workers", "0"]) == 2
    assert "--workers: must be positive" in capsys.readouterr().err


def test_cli_prints_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(SMALL) + "\n")
    assert rp.main([str(trace), "--workers", "1", "--policy", "round-robin", "--block-size", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prefix_hit_rate_total"] == pytest.approx(22 / 39)
    assert rp.main([str(trace), "--block-size", "4"]) == 0
    assert "prefix_hit_rate_total" in capsys.readouterr().out


def test_mooncake_one_worker_sequential_gives_the_published_share() -> None:
    trace = rp.load_trace(require(MOONCAKE))
    assert len(trace.requests) == 3993 and trace.skipped == 0
    result = rp.replay(trace, workers=1, policy="round-robin", capacity_blocks=10**7)
    # data README: token-weighted prefix hit share 0.651 with one global cache, sequential
    assert round(result["prefix_hit_rate_total"], 3) == 0.651


def test_mooncake_policies_and_timing_order() -> None:
    trace = rp.load_trace(require(MOONCAKE))
    trace.requests = trace.requests[:1200]  # enough shared prefixes to separate the policies
    rate = {p: rp.replay(trace, 8, p, capacity_blocks=100_000)["prefix_hit_rate_total"]
            for p in ("round-robin", "consistent-hash", "prefix-tree")}
    assert rate["round-robin"] < rate["consistent-hash"]
    assert rate["round-robin"] < rate["prefix-tree"]
    timed = rp.replay(trace, 8, "prefix-tree", capacity_blocks=100_000, timed=True)["prefix_hit_rate_total"]
    assert timed <= rate["prefix-tree"]


def test_one_mooncake_reader_for_the_simulator_and_the_replay() -> None:
    """``prefixscope replay`` and ``prefixscope sim --trace`` read the trace into the same requests."""
    path = require(MOONCAKE)
    sim, errors = load_mooncake(path)
    what_if = rp.load_trace(path)
    assert errors == [] and what_if.skipped == 0 and what_if.format == "mooncake"
    assert [(r.t, r.line, r.input_length, r.output_length, r.hash_ids) for r in sim] == \
        [(r.t, r.line, r.prompt_tokens, r.output_tokens, r.block_hashes) for r in what_if.requests]
    # The partial last block: the simulator replays full blocks only (vLLM never caches a partial
    # block); the what-if counts it, padding the prompt to whole blocks.
    first_sim, first_what_if = next(replay_requests(sim)), what_if.requests[0]
    assert len(first_sim.block_hashes) == 40160 // 512 and len(first_what_if.block_hashes) == 40160 // 512 + 1
    assert first_what_if.hit_tokens(len(first_what_if.block_hashes)) == 40160


def test_mooncake_errors_read_the_same_on_both_paths() -> None:
    lines = [*mooncake_lines((5, 1000, [1, 2])), "{not json",
             *mooncake_lines((-1, 10, [1]), (6, 1000, [1]), (1005, 600, [1, 9]))]
    sim, errors = parse_mooncake(lines)
    what_if = rp.parse_trace(lines)
    assert [(r.t, r.hash_ids) for r in sim] == [(r.t, r.block_hashes) for r in what_if.requests] == \
        [(0.0, (1, 2)), (1.0, (1, 9))]
    assert what_if.skipped == len(errors) == 3 and what_if.first_error == errors[0]
    assert errors[0] == "line 2: not JSON (Expecting property name enclosed in double quotes)"


def test_out_of_order_mooncake_lines_replay_in_time_order() -> None:
    sim, _ = parse_mooncake(mooncake_lines((2000, 10, [1]), (1000, 10, [2]), (1000, 10, [3])))
    assert [(r.t, r.line) for r in sim] == [(0.0, 2), (0.0, 3), (1.0, 1)]
