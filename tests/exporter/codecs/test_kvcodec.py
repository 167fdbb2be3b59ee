"""KV-event payload decoding: both encodings, int/bytes hashes, bad input counted."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest

from exporter.codecs import kvcodec
from exporter.core.health import Health
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
BIG = 15760518052499183552  # ≥ 2^63, from the vLLM 0.26 capture


def _decode(name: str, health: Health | None = None):
    return kvcodec.decode_batch((FIXTURES / name).read_bytes(), "w0", 7, health or Health())


def _errors(health: Health) -> dict:
    return health.snapshot()[0].get("prefixscope_ingest_errors", {})


def test_real_capture_map_encoding() -> None:
    batch = _decode("kv_capture_0_26_map.msgpack")
    assert (batch.worker, batch.seq, batch.ts, batch.dp_rank) == ("w0", 7, 1789095808.8378847, 0)
    assert batch.events == (BlockStored((BIG,), None, 16, 16, "GPU"),)


def test_array_encoding_0_23_equals_map_encoding() -> None:
    batch = _decode("kv_array_0_23.msgpack")
    assert batch.events == (BlockStored((BIG,), None, 16, 16, "GPU"), BlockRemoved((11,), "GPU"), AllBlocksCleared())


def test_map_omit_defaults() -> None:
    batch = _decode("kv_map_omit_defaults.msgpack")
    assert batch.dp_rank == 1
    assert batch.events == (BlockStored((101, 102), 100, 16, 32, "GPU"), BlockRemoved((11,), "GPU"), AllBlocksCleared())


def test_array_0_9_short_events_and_missing_dp_rank() -> None:
    batch = _decode("kv_array_0_9_no_dp_rank.msgpack")
    assert batch.dp_rank is None and batch.ts == 1750000000.25
    assert batch.events == (BlockStored((7, 8, 9), 6, 16, 48, "GPU"), BlockRemoved((7,), "GPU"))


def test_bytes_hashes_use_last_8_bytes_big_endian() -> None:
    batch = _decode("kv_bytes_hashes.msgpack")
    assert batch.dp_rank is None
    assert batch.events == (BlockStored((BIG,), 42, 16, 16, "GPU"), BlockRemoved((BIG,), "GPU"))


def test_negative_i64_hash_rejects_the_batch() -> None:
    health = Health()
    assert _decode("kv_negative_i64.msgpack", health) is None
    assert _errors(health) == {("kv_events", "decode"): 1.0}


@pytest.mark.parametrize("bad", [1.5, True, False, -1, "abc", b"", None, [1], {"h": 1}])
@pytest.mark.parametrize("where", ["hash", "parent", "removed"])
def test_a_hash_that_is_not_u64_or_bytes_rejects_the_batch(bad: object, where: str) -> None:
    if where == "parent" and bad is None:
        return  # no parent: the first block of a chain
    stored = {"type": "BlockStored", "block_hashes": [bad if where == "hash" else 5, 6], "block_size": 16,
              "parent_block_hash": bad if where == "parent" else 4}
    removed = ["BlockRemoved", [7, bad] if where == "removed" else [7]]
    for events in ([stored, removed], [removed, stored]):
        health = Health()
        assert kvcodec.decode_batch(msgpack.packb([1.0, events, 0], use_bin_type=True), "w0", 1, health) is None
        assert _errors(health) == {("kv_events", "decode"): 1.0}


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_batch_timestamp_is_a_decode_error(ts: float) -> None:
    health = Health()
    assert kvcodec.decode_batch(msgpack.packb([ts, [], 0]), "w0", 1, health) is None
    assert _errors(health) == {("kv_events", "decode"): 1.0}


def test_largest_u64_and_single_byte_hashes_are_accepted() -> None:
    obj = [5.0, [["BlockStored", [2**64 - 1, b"\x07"], 2**64 - 1, [], 16]], 0]
    batch = kvcodec.decode_batch(msgpack.packb(obj, use_bin_type=True), "w", 2)
    assert batch.events == (BlockStored((2**64 - 1, 7), 2**64 - 1, 16, 0, "GPU"),)


def test_unknown_event_counted_rest_kept() -> None:
    health = Health()
    batch = _decode("kv_unknown_event.msgpack", health)
    assert batch.events == (BlockStored((1,), None, 16, 16, "GPU"), BlockRemoved((1,), "GPU"))
    assert _errors(health) == {("kv_events", "unknown_event"): 1.0}


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"not msgpack at all \xff\xfe", msgpack.packb([1, 2]) + b"x"])
def test_not_msgpack_is_a_decode_error(payload: bytes) -> None:
    health = Health()
    assert kvcodec.decode_batch(payload, "w0", 1, health) is None
    assert _errors(health) == {("kv_events", "decode"): 1.0}


@pytest.mark.parametrize("obj", [{"ts": 1}, [1.0], ["x", []], [1.0, "events"], 42, [True, []]])
def test_not_a_batch_is_a_decode_error(obj: object) -> None:
    health = Health()
    assert kvcodec.decode_batch(msgpack.packb(obj), "w0", 1, health) is None
    assert _errors(health) == {("kv_events", "decode"): 1.0}


def test_bad_events_counted_rest_kept() -> None:
    obj = [5.0, [
        ["BlockStored", [1], None],                                 # too few fields
        ["BlockStored", [4], None, [], 16, None, 7],                # medium of the wrong type
        {"type": "BlockStored", "block_hashes": [2], "block_size": 0},  # impossible block size
        {"type": "BlockRemoved"},                                   # no hashes
        "a string",                                                 # not an event
        ["BlockStored", [3], 2, [0] * 16, 16, None, "GPU"],
        {"no_type": 1},                                             # unknown (no tag)
    ], 0]
    health = Health()
    batch = kvcodec.decode_batch(msgpack.packb(obj), "w0", 1, health)
    assert batch.events == (BlockStored((3,), 2, 16, 16, "GPU"),)
    assert _errors(health) == {("kv_events", "bad_event"): 5.0, ("kv_events", "unknown_event"): 1.0}


def test_empty_events_and_mixed_hash_types() -> None:
    obj = [5.0, [["BlockStored", [1, b"\x00" * 7 + b"\x02", 2**64 - 1], None, [], 16]], 3]
    batch = kvcodec.decode_batch(msgpack.packb(obj, use_bin_type=True), "w", 2)
    assert batch.events[0].hashes == (1, 2, 2**64 - 1)
    assert kvcodec.decode_batch(msgpack.packb([5.0, [], 0]), "w", 3).events == ()


def test_fast_path_agrees_with_the_careful_readers() -> None:
    """The inline fast path and the careful per-field readers decode every shape alike."""
    import random

    rng = random.Random(3)
    hashes = [[1, 2], [2**64 - 1], [], [-5], [b"\x00" * 31 + b"\x07"], [1, b"\x01"], ["x"], None, [1.0], [True, 2]]
    parents = [None, 0, 7, 2**63, -1, b"\x00\x09", "p", 1.0, False]
    sizes = [16, 1, 0, -16, 16.0, None, "16"]
    tokens = [None, [], list(range(32)), 5, "abc"]
    for _ in range(2000):
        hs, p, bs, tok = rng.choice(hashes), rng.choice(parents), rng.choice(sizes), rng.choice(tokens)
        medium = rng.choice(["GPU", "CPU", None, 3])
        events = [
            {"type": "BlockStored", "block_hashes": hs, "parent_block_hash": p, "token_ids": tok, "block_size": bs, "medium": medium},
            ["BlockStored", hs, p, tok, bs, None, medium, None],
            {"type": "BlockRemoved", "block_hashes": hs, "medium": medium},
            ["BlockRemoved", hs, medium],
        ]
        for ev in events:
            packed = msgpack.packb([1.0, [ev], 0], use_bin_type=True)
            batch = kvcodec.decode_batch(packed, "w", 0, Health())
            got = None if batch is None else batch.events
            raw = msgpack.unpackb(packed, raw=False, strict_map_key=False, use_list=False)[1][0]
            try:
                expected = ((kvcodec._from_map if isinstance(raw, dict) else kvcodec._from_array)(raw),)
            except kvcodec.BadHash:
                expected = None
            except (kvcodec.BadEvent, KeyError, TypeError, ValueError, IndexError):
                expected = ()
            assert got == expected, ev


def test_fast_path_events_are_the_model_classes_with_every_field():
    payload = msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [5, 6], "parent_block_hash": 4,
                                    "token_ids": list(range(32)), "block_size": 16, "medium": "CPU"},
                                   {"type": "BlockRemoved", "block_hashes": [5]}], 0])
    stored, removed = kvcodec.decode_batch(payload, "w0", 0).events
    assert type(stored) is BlockStored and type(removed) is BlockRemoved
    assert (stored.hashes, stored.parent, stored.block_size, stored.token_count, stored.medium) == ((5, 6), 4, 16, 32, "CPU")
    assert removed == BlockRemoved((5,)) and hash(removed) == hash(BlockRemoved((5,), "GPU"))
    with pytest.raises(AttributeError):  # still frozen
        removed.medium = "CPU"  # type: ignore[misc]
