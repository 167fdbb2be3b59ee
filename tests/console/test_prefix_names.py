"""Named prefixes: token ids kept from KV events, detokenized by a worker, served per hot branch."""

from __future__ import annotations

import msgpack
import pytest

from exporter.codecs.kvcodec import decode_batch
from exporter.core.prefix_text import (
    Ask,
    Detokenizer,
    PrefixNames,
    PrefixTokens,
    TokenTee,
    http_detokenize,
    short_text,
)
from exporter.model import BlockStored, KvBatch
from exporter.web.api import ApiBuilders
from fleet import tokenizer
from fleet.clock import VirtualClock
from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from tests.console import cluster

PROMPT = tokenizer.encode("You are a support agent for ACME. Answer briefly.")


def test_the_codec_keeps_each_event_s_token_ids_in_both_shapes() -> None:
    array = ["BlockStored", (7, 8), None, tuple(PROMPT[:32]), 16, None, "GPU"]
    mapping = {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": 7, "token_ids": PROMPT[:16],
               "block_size": 16}
    batch = decode_batch(msgpack.packb([1.0, [array, mapping]]), "w0", 0)
    assert batch is not None
    assert [ev.token_ids for ev in batch.events] == [tuple(PROMPT[:32]), tuple(PROMPT[:16])]
    assert batch.events[0] == BlockStored((7, 8), None, 16, 32, "GPU")  # not part of the identity


def test_only_the_first_block_of_families_and_their_children_is_kept_bounded() -> None:
    kept = PrefixTokens(max_kept=4, max_tokens=8)
    kept.observe([BlockStored((1, 2), None, 16, 32, token_ids=tuple(range(32))),  # a root: each block kept
                  BlockStored((3, 9), 7, 16, 32, token_ids=tuple(range(32))),  # parent 7 was not kept
                  BlockStored((4, 8), 2, 16, 32, token_ids=tuple(range(50, 82)))])  # child of a kept block
    assert kept.get(1) == tuple(range(8)) and kept.get(2) == tuple(range(16, 24))
    assert kept.get(3) is None and kept.get(4) == tuple(range(50, 58)) and kept.get(8) is None
    kept.observe([BlockStored((5, 6), None, 16, 32, token_ids=tuple(range(32)))])
    assert len(kept) == 4 and kept.get(1) is None and kept.get(2) is not None  # the oldest went first
    kept.observe([BlockStored((10,), None, 16, 16, token_ids=("a", "b"))])  # not token ids
    assert kept.get(10) is None


def test_the_detokenizer_asks_off_the_request_path_caches_and_backs_off() -> None:
    calls: list[tuple[str, str | None, tuple[int, ...]]] = []
    answers = {"http://w1": "You are"}
    now = [0.0]

    def fake(url: str, model: str | None, tokens) -> str | None:
        calls.append((url, model, tuple(tokens)))
        return answers.get(url)

    d = Detokenizer(fake, clock=lambda: now[0], retry_s=60)
    names = PrefixNames(PrefixTokens(), d, {"w0": "http://w0", "w1": "http://w1"})
    names.tokens.observe([BlockStored((1,), None, 16, 16, token_ids=(10, 11))])
    assert names.name(1, ["w0"], {"w0": "m"}) == {"text": None, "token_ids": [10, 11]}  # not asked yet
    assert calls == []
    d.drain()
    assert calls == [("http://w0", "m", (10, 11)), ("http://w1", None, (10, 11))]  # holders first
    assert names.name(1, ["w0"], {})["text"] == "You are"
    d.want(Ask(2, (1,), (("http://w0", None),)))
    d.drain()
    d.want(Ask(2, (1,), (("http://w0", None),)))  # failed a moment ago: not asked again yet
    d.drain()
    assert len(calls) == 3
    now[0] = 61
    d.want(Ask(2, (1,), (("http://w0", None),)))
    d.drain()
    assert len(calls) == 4
    assert short_text("a\n  b " * 40, 10) == "a b a b a…"


@pytest.fixture(scope="module")
def worker_url():
    # The crafted cluster's workers serve model "m" (tests/console/cluster.py).
    with WorkerFleet([WorkerSpec("w0", model="m", block_size=16)], clock=VirtualClock(), options=FleetOptions()) as f:
        yield f["w0"].url


def test_the_simulated_worker_detokenizes_like_vllm(worker_url: str) -> None:
    import requests

    r = requests.post(f"{worker_url}/detokenize", json={"model": "m", "tokens": PROMPT[:9]}, timeout=10)
    assert r.status_code == 200 and r.json() == {"prompt": "You are a"}
    assert http_detokenize(worker_url, None, PROMPT[:3]) == "You"
    bad = requests.post(f"{worker_url}/detokenize", json={"tokens": ["x"]}, timeout=10)
    assert bad.status_code == 400
    assert http_detokenize(worker_url, "another-model", PROMPT[:3]) is None  # vLLM's 404 for a wrong model
    assert http_detokenize("http://127.0.0.1:9", None, PROMPT[:3]) is None  # nobody there


def test_hot_branches_carry_their_text_through_the_api(worker_url: str) -> None:
    state = cluster.build_state()
    names = PrefixNames(PrefixTokens(), Detokenizer(), {"w0": worker_url, "w1": worker_url})
    tee = TokenTee(state, names.tokens)
    # The crafted cluster's chain starts at block 11: teach the names its tokens as vLLM sends them.
    tee.apply_kv_batch(KvBatch("w0", 1, 941.0, (BlockStored((11, 12, 13), None, 16, 16,
                                                            token_ids=tuple(PROMPT[:48])),)), 941.0)
    hot = ApiBuilders(state, names=names).routes()["hotspots"]
    first = hot({"k": "3"})["hot_branches"]
    assert first and first[0]["token_ids"] == PROMPT[:48] and first[0]["text"] is None
    names.detokenizer.drain()
    # The branch's run (blocks 11–14, three of them kept), not its first block's 16 characters.
    assert hot({"k": "3"})["hot_branches"][0]["text"] == "You are a support agent for ACME. Answer briefly"
    # The tree and the changes name their branches the same way.
    assert ApiBuilders(state, names=names).routes()["tree"]({})["root"]["children"][0]["text"] == \
        "You are a support agent for ACME. Answer briefly"
    plain = ApiBuilders(state).routes()["hotspots"]({"k": "3"})["hot_branches"][0]  # text off: hashes only
    assert plain["text"] is None and plain["token_ids"] is None
