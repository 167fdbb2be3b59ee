"""Workloads and Mooncake trace replay: the request streams the scenarios are built from."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter, defaultdict
from pathlib import Path

from fleet.hashing import chain_hashes
from fleet.prompt_text import tenant_prompt
from fleet.tokenizer import decode, encode
from fleet.traces import load_mooncake, parse_mooncake, replay_requests
from fleet.workloads import TIMESTAMP_TOKENS, WorkloadGenerator, WorkloadParams, clock_text, generate

BASE = WorkloadParams()


def _stream(duration: float = 600, seed: int = 3, **over):
    return list(generate([(0.0, BASE.with_overrides(over))], duration, seed=seed, keep_tokens=True))


def test_the_stream_is_time_ordered_deterministic_and_seeded() -> None:
    a, b, c = _stream(seed=3), _stream(seed=3), _stream(seed=4)
    assert [r.t for r in a] == sorted(r.t for r in a)
    assert [(r.request_id, r.block_hashes) for r in a] == [(r.request_id, r.block_hashes) for r in b]
    assert [r.block_hashes for r in a] != [r.block_hashes for r in c]


def test_block_hashes_are_the_chained_hashes_of_the_prompt_tokens() -> None:
    for r in _stream(duration=120):
        assert r.token_ids is not None and len(r.token_ids) == r.prompt_tokens
        assert r.block_hashes == chain_hashes(r.token_ids, 16)


def test_follow_ups_extend_the_previous_turn_and_tenants_share_a_system_prompt() -> None:
    reqs = [r for r in _stream() if r.kind == "chat"]
    by_conv = defaultdict(list)
    for r in reqs:
        by_conv[r.conversation].append(r)
    multi = [v for v in by_conv.values() if len(v) > 1]
    assert multi
    for turns in multi:
        assert [t.turn for t in turns] == list(range(1, len(turns) + 1))
        for prev, nxt in itertools.pairwise(turns):
            # the next prompt is the previous prompt + the answer + a new user message
            assert nxt.token_ids[: prev.prompt_tokens] == prev.token_ids
            assert nxt.prompt_tokens >= prev.prompt_tokens + 80 + 40
    # BASE has 4 tenants; a tenant prefix is system + tools = 4000 tokens = 250 blocks
    roots = Counter(r.block_hashes[249] for r in reqs if r.turn == 1)
    assert len(roots) == BASE.tenants and sum(roots.values()) == sum(1 for r in reqs if r.turn == 1)


def test_rates_follow_the_parameters() -> None:
    reqs = _stream(duration=1200, chat_sessions_per_s=0.5, doc_per_s=0.05, cold_sessions_per_s=0.0,
                   docqa_per_s=0.0, extract_per_s=0.0)
    kinds = Counter(r.kind for r in reqs)
    new_chats = sum(1 for r in reqs if r.kind == "chat" and r.turn == 1)
    assert 0.4 * 1200 < new_chats < 0.6 * 1200
    assert 0.03 * 1200 < kinds["doc"] < 0.07 * 1200
    assert kinds.keys() <= {"chat", "doc"}
    assert all(8000 <= r.prompt_tokens <= 20000 for r in reqs if r.kind == "doc")


def test_timestamp_in_the_system_prompt_breaks_every_shared_first_block() -> None:
    normal = [r for r in _stream(duration=300) if r.kind == "chat"]
    stamped = [r for r in _stream(duration=300, timestamp_in_system_prompt=True) if r.kind == "chat"]
    assert len({r.block_hashes[0] for r in normal}) == BASE.tenants
    assert len({r.block_hashes[0] for r in stamped}) == len(stamped)  # root fan-out = one per request


def test_key_churn_continues_the_conversation_under_a_new_key() -> None:
    reqs = _stream(rekey_prob=1.0, rekey_segments=["web", "mobile", "api"])
    by_conv = defaultdict(list)
    for r in reqs:
        if r.kind == "chat":
            by_conv[r.conversation].append(r)
    turns = next(v for v in by_conv.values() if len(v) >= 3)
    assert len({t.session_key for t in turns}) == len(turns)  # a new key at every follow-up
    assert turns[2].token_ids[: turns[1].prompt_tokens] == turns[1].token_ids  # same conversation
    title = _stream(rekey_prob=1.0, rekey_mode="title", rekey_segments=["web", "mobile", "api"])
    t_conv = defaultdict(list)
    for r in title:
        if r.kind == "chat":
            t_conv[r.conversation].append(r.session_key)
    keys = next(v for v in t_conv.values() if len(v) >= 2)
    assert keys[0] != keys[1] and keys[0][:-4] == keys[1][:-4]  # only the tail changes


def test_document_qa_is_keyless_and_shares_the_document_only() -> None:
    reqs = [r for r in _stream(docqa_per_s=0.2, chat_sessions_per_s=0.0) if r.kind == "docqa"]
    assert reqs and all(r.session_key is None and r.segment == "api" for r in reqs)
    by_doc = defaultdict(list)
    for r in reqs:
        by_doc[r.conversation].append(r)
    qs = next(v for v in by_doc.values() if len(v) >= 2)
    doc_blocks = min(len(q.block_hashes) for q in qs) - 16  # questions add ≤ 240 tokens
    assert qs[0].block_hashes[:doc_blocks] == qs[1].block_hashes[:doc_blocks]


def test_a_phase_switch_applies_from_its_start() -> None:
    phases = [(0.0, BASE.with_overrides({"extract_per_s": 0.0})),
              (300.0, BASE.with_overrides({"extract_per_s": 0.5}))]
    reqs = list(generate(phases, 600, seed=1))
    extracts = [r.t for r in reqs if r.kind == "extract"]
    assert extracts and min(extracts) >= 300 and len(extracts) > 100


def test_mooncake_trace_parses_and_replays_full_blocks_only(mooncake_trace: Path) -> None:
    trace, errors = load_mooncake(mooncake_trace)
    assert errors == [] and len(trace) == 3993
    assert trace[0].t == 0 and 16 * 60 < trace[-1].t < 18 * 60  # 17 minutes
    first = next(replay_requests(trace))
    # 40160 tokens = 78 full blocks of 512 + a 224-token remainder that is never cached
    assert (first.prompt_tokens, len(first.block_hashes), first.block_size) == (40160, 78, 512)
    assert first.block_hashes == list(range(78)) and first.session_key is None


def test_bad_trace_lines_are_reported_and_skipped() -> None:
    good = json.dumps({"timestamp": 5, "input_length": 1000, "output_length": 3, "hash_ids": [1, 2]})
    lines = [
        good,
        "{not json",
        json.dumps([1, 2]),
        json.dumps({"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}),
        json.dumps({"timestamp": 6, "input_length": 1000, "output_length": 3, "hash_ids": [1]}),
        json.dumps({"timestamp": 7, "input_length": 10, "output_length": 3, "hash_ids": ["a"]}),
        "",
        json.dumps({"timestamp": 1005, "input_length": 600, "output_length": 0, "hash_ids": [1, 9]}),
    ]
    trace, errors = parse_mooncake(lines)
    assert [(t.t, t.hash_ids) for t in trace] == [(0.0, (1, 2)), (1.0, (1, 9))]
    assert errors == [
        "line 2: not JSON (Expecting property name enclosed in double quotes)",
        "line 3: must be a JSON object",
        "line 4: timestamp must be a number of milliseconds ≥ 0, got -1",
        "line 5: hash_ids has 1 ids for input_length 1000 (expected 2 blocks of 512)",
        "line 6: hash_ids must be a list of unsigned 64-bit integers",
    ]


def test_prompts_are_readable_text_of_exactly_their_token_counts() -> None:
    reqs = _stream(duration=300, docqa_per_s=0.05, fork_prob=0.3)
    assert {r.kind for r in reqs} >= {"chat", "cold", "doc", "docqa", "extract"}
    for r in reqs:
        text = decode(r.token_ids)
        assert len(text) == r.prompt_tokens and text.isascii()
        assert text.replace("\n", " ").isprintable()
        assert encode(text) == r.token_ids
    first = {r.kind: decode(r.token_ids[:16]) for r in reqs if r.turn == 1}
    assert re.fullmatch(r"[A-Z][a-z]+ [a-z]+ [a-z ]+", first["chat"])  # "Acme billing ass"
    assert re.fullmatch(r"Report [0-9a-f]{8}:", first["doc"])
    assert re.fullmatch(r"Invoice [0-9a-f]{8}", first["extract"])
    assert re.fullmatch(r"Manual [0-9a-f]{8}:", first["docqa"])
    assert re.fullmatch(r"Agent [0-9a-f]{8}: ", first["cold"])
    # a chat session's first user turn starts on a block boundary with the user's id, and the
    # follow-ups are signed the same way
    chat = next(r for r in reqs if r.kind == "chat" and r.turn == 2)
    text = decode(chat.token_ids)
    users = re.findall(r"\n([0-9a-f]{8}): ", text)
    assert len(users) == 2 and users[0] == users[1]
    assert text[4000:4010] == users[0] + ": "
    assert "\nassistant: " in text


def test_what_must_share_nothing_differs_in_its_first_block() -> None:
    reqs = _stream(duration=600, docqa_per_s=0.05)
    roots = [r for r in reqs if r.turn == 1 and r.kind != "chat"]
    assert len({r.block_hashes[0] for r in roots}) == len(roots)
    tenant_blocks = (BASE.system_tokens + BASE.tool_tokens) // 16
    firsts = [r for r in reqs if r.turn == 1 and r.kind == "chat"]
    assert len({r.block_hashes[tenant_blocks] for r in firsts}) == len(firsts)


def test_tenants_are_named_in_their_first_block_and_may_run_on_a_lora_adapter() -> None:
    assert len({tenant_prompt(i, 100, 0)[:16] for i in range(560)}) == 560
    assert tenant_prompt(0, 100, 0)[:16] == "Acme billing ass"
    gen = WorkloadGenerator([(0.0, BASE.with_overrides({"tenants": 3, "tenant_loras": ("billing-v2", None, "billing-v2"),
                                                        "fork_prob": 0.5}))], 300, seed=2)
    shared = gen.shared_prompts()
    assert [(s.lora_name, s.lora_id) for s in shared] == [("billing-v2", 1), (None, None), ("billing-v2", 1)]
    assert [decode(s.token_ids[:16]) for s in shared] == ["Acme billing ass", "Globex support a", "Hooli travel ass"]
    by_tenant = defaultdict(set)
    for r in gen.requests():
        if r.kind == "chat" or (r.kind == "fork" and decode(r.token_ids[:6]) != "Agent "):  # not a cold fork
            by_tenant[decode(r.token_ids[:16])].add((r.lora_name, r.lora_id))
        else:
            assert r.lora_name is None and r.lora_id is None
    assert by_tenant == {"Acme billing ass": {("billing-v2", 1)}, "Globex support a": {(None, None)},
                         "Hooli travel ass": {("billing-v2", 1)}}


def test_the_timestamp_is_a_time_of_day_filling_the_first_block() -> None:
    assert clock_text(0.0) == "08:00:00.000000\n" and clock_text(3723.25) == "09:02:03.250000\n"
    stamped = [r for r in _stream(duration=120, timestamp_in_system_prompt=True) if r.kind == "chat"]
    for r in stamped:
        head = decode(r.token_ids[:TIMESTAMP_TOKENS])
        assert re.fullmatch(r"\d\d:\d\d:\d\d\.\d{6}\n", head) and head == clock_text(r.t)


def test_a_document_corpus_comes_back_under_each_documents_own_key() -> None:
    """With doc_pool, document analysis asks new questions about the same few documents: each
    document keeps its key and its tokens (so its blocks), only the question after it changes."""
    docs = [r for r in _stream(duration=600, seed=5, doc_per_s=0.5, doc_pool=6, doc_tokens=(800, 1200))
            if r.kind == "doc"]
    by_key = defaultdict(list)
    for r in docs:
        by_key[r.session_key].append(r)
    assert len(docs) > 100 and 1 < len(by_key) <= 6  # ~300 questions about at most six documents
    for key, visits in by_key.items():
        assert key is not None and [r.turn for r in visits] == list(range(1, len(visits) + 1))
        doc_blocks = min(len(r.block_hashes) for r in visits) - 16  # a question is at most 240 tokens
        assert len({tuple(r.block_hashes[:doc_blocks]) for r in visits}) == 1  # the same document ...
        assert len({tuple(r.token_ids or ()) for r in visits}) == len(visits)  # ... asked something new
    unique = [r for r in _stream(duration=600, seed=5, doc_per_s=0.5) if r.kind == "doc"]
    assert len({r.session_key for r in unique}) == len(unique)  # without a pool every document is new


def test_a_tenant_may_send_a_cache_salt_published_in_its_first_blocks_extra_keys() -> None:
    from fleet.cache import Stored
    from fleet.kv_publisher import encode_event

    gen = WorkloadGenerator([(0.0, BASE.with_overrides({"tenants": 2, "tenant_loras": ("billing-v2",),
                                                        "tenant_salts": ("acme", None), "fork_prob": 0.5}))],
                            300, seed=2)
    assert [(s.lora_name, s.cache_salt) for s in gen.shared_prompts()] == [("billing-v2", "acme"), (None, None)]
    by_tenant = defaultdict(set)
    for r in gen.requests():
        if r.kind in ("chat", "fork") and decode(r.token_ids[:6]) != "Agent ":
            by_tenant[decode(r.token_ids[:16])].add((r.lora_name, r.cache_salt))
        else:
            assert r.cache_salt is None
    assert by_tenant == {"Acme billing ass": {("billing-v2", "acme")}, "Globex support a": {(None, None)}}
    root = Stored((1, 2), None, (), 16, lora_name="billing-v2", cache_salt="acme")
    assert encode_event(root, "map")["extra_keys"] == [["billing-v2", "acme"], ["billing-v2"]]
    assert encode_event(Stored((1,), None, (), 16, cache_salt="acme"), "array")[8] == [["acme"]]
    later = Stored((3,), 2, (), 16, lora_name="billing-v2", cache_salt="acme")  # not the prompt's first block
    assert encode_event(later, "map")["extra_keys"] == [["billing-v2"]]
