"""The KV decoder's typed path (msgspec) and its careful path (msgpack + readers) agree.

``decode_batch`` takes the typed path when msgspec accepts the payload and the careful path
otherwise; on every batch the typed path accepts, the careful path must give the same batch (same
events, timestamp, DP rank, token counts and — when asked for — token ids) and count no error.
The streams are near-valid vLLM batches in both encodings with hostile values mixed in.
"""

from __future__ import annotations

import pickle

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.ingest import payloads
from exporter.codecs import kvcodec
from exporter.core.health import Health
from exporter.core.index.eviction import is_gpu
from exporter.core.index.prefix_instability import (
    COMPARED_BLOCKS,
    EARLY_SPAN_BLOCKS,
    MIN_SHARED_BLOCKS,
    ROOT_KEYS,
    root_key,
)
from exporter.model import AllBlocksCleared, BlockRemoved, BlockStored

MASK64 = (1 << 64) - 1
SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

hostile = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), MASK64), st.floats(), st.binary(max_size=12),
                    st.text(max_size=6), st.lists(st.integers(0, 3), max_size=2))
good_hash = st.one_of(st.integers(0, 40), st.integers(2**63, MASK64))
good_hashes = st.lists(good_hash, max_size=4)
good_medium = st.sampled_from(["GPU", "CPU", "disk", None])
good_tokens = st.lists(st.integers(0, 128000), max_size=40)
extra = st.dictionaries(st.sampled_from(["lora_id", "lora_name", "extra_keys", "group_idx", "locality", "session_id",
                                         "ownership", "x"]), hostile, max_size=3)
# vLLM >= 0.26 / 0.30: a block's locality and a store's session (the newer fields the decoder reads)
good_locality = st.sampled_from(["LOCAL", "REMOTE", None])
good_session = st.sampled_from(["chat-1", "chat-2", "", None])
KINDS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


@st.composite
def map_event(draw: st.DrawFn) -> dict:
    kind = draw(st.sampled_from(KINDS))
    ev: dict = {"type": kind, **draw(extra)}
    if kind == "BlockStored":
        ev |= {"block_hashes": draw(good_hashes), "block_size": 16}
        for key, value in (("parent_block_hash", st.none() | good_hash), ("token_ids", good_tokens),
                           ("medium", good_medium), ("locality", good_locality), ("session_id", good_session)):
            if draw(st.booleans()):
                ev[key] = draw(value)
    elif kind == "BlockRemoved":
        ev["block_hashes"] = draw(good_hashes)
        for key, value in (("medium", good_medium), ("locality", good_locality)):
            if draw(st.booleans()):
                ev[key] = draw(value)
    return ev


@st.composite
def array_event(draw: st.DrawFn) -> list:
    kind = draw(st.sampled_from(KINDS))
    if kind == "BlockStored":
        fields = [kind, draw(good_hashes), draw(st.none() | good_hash), draw(good_tokens), 16, draw(hostile),
                  draw(good_medium), *draw(st.lists(hostile, max_size=4))]
        if len(fields) == 11 and draw(st.booleans()):  # vLLM 0.33's whole array: locality 12, session 14
            fields += [None, draw(good_locality), draw(hostile), draw(good_session),
                       *draw(st.lists(hostile, max_size=2))]
        return fields[:draw(st.integers(5, len(fields)))]
    if kind == "BlockRemoved":
        fields = [kind, draw(good_hashes), draw(good_medium), *draw(st.lists(hostile, max_size=3))]
        if len(fields) == 4 and draw(st.booleans()):
            fields += [draw(good_locality), *draw(st.lists(hostile, max_size=2))]
        return fields[:draw(st.integers(2, len(fields)))]
    return [kind, *draw(st.lists(hostile, max_size=2))]


@st.composite
def batch(draw: st.DrawFn) -> list:
    """A valid batch of one encoding; half of them then get one hostile change."""
    events = draw(st.lists(map_event() if draw(st.booleans()) else array_event(), max_size=6))
    out = [draw(st.floats(1e9, 2e9) | st.integers(0, 2**40)), events, draw(st.integers(0, 7) | st.none())]
    if draw(st.booleans()):
        return out
    where = draw(st.integers(-1, len(events) - 1))
    if where < 0:  # the batch itself
        i = draw(st.integers(0, 3))
        if i < 3:
            out[i] = draw(hostile | st.floats())
        else:
            out = out[:2] + draw(st.lists(hostile, min_size=1, max_size=2))
        return out
    ev = events[where]
    change = draw(st.integers(0, 3))
    if change == 0:  # another encoding or no event at all
        events[where] = draw(array_event() if isinstance(ev, dict) else map_event()) if draw(st.booleans()) \
            else draw(hostile)
    elif isinstance(ev, dict):
        key = draw(st.sampled_from(["type", "block_hashes", "block_size", "parent_block_hash", "token_ids", "medium",
                                    "locality", "session_id"]))
        if change == 1:
            ev.pop(key, None)
        elif change == 2 and key == "block_hashes":
            ev[key] = [*ev.get(key, []), draw(hostile | st.binary(min_size=1, max_size=32))]
        else:
            ev[key] = draw(hostile | st.sampled_from(["Nope", *KINDS]))
    else:
        i = draw(st.integers(0, len(ev)))
        if change == 1:
            del ev[i:]
        elif change == 2 and len(ev) > 1:
            ev[1] = [*ev[1], draw(hostile | st.binary(min_size=1, max_size=32))] if type(ev[1]) is list else ev[1]
        elif i < len(ev):
            ev[i] = draw(hostile | st.sampled_from(["Nope", *KINDS]))
    return out


def _both(payload: bytes) -> tuple:
    fast_health, careful_health = Health(), Health()
    fast = kvcodec.decode_batch(payload, "w", 5, fast_health, token_ids=True)
    careful = kvcodec.decode_careful(payload, "w", 5, careful_health)
    return fast, careful, fast_health.snapshot()[0], careful_health.snapshot()[0]


def _same(fast, careful) -> None:
    if careful is None:
        assert fast is None
        return
    assert fast == careful  # worker, seq, ts, dp_rank, events (hashes, parent, size, token count, medium)
    assert [ev.token_ids for ev in fast.events if isinstance(ev, BlockStored)] == \
           [ev.token_ids for ev in careful.events if isinstance(ev, BlockStored)]


@SETTINGS
@given(batch())
def test_typed_and_careful_paths_agree(obj: list) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    fast, careful, fast_counts, careful_counts = _both(payload)
    _same(fast, careful)
    assert fast_counts == careful_counts  # the same errors, counted once


@SETTINGS
@given(batch(), st.data())
def test_damaged_payloads_agree_or_are_read_by_neither(obj: list, data: st.DataObject) -> None:
    payload = bytearray(msgpack.packb(obj, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(payload) - 1))
        payload[i] = data.draw(st.integers(0, 255))
    payload = bytes(payload[:data.draw(st.integers(0, len(payload)))])
    try:
        msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=False)
    except Exception:
        # Not readable msgpack: the typed path may still accept it when the damage sits in a field
        # the exporter does not read; then what it returns must be valid.
        fast = kvcodec.decode_batch(payload, "w", 5, Health())
        if fast is not None:
            assert all(0 <= h <= MASK64 and type(h) is int for ev in fast.events for h in getattr(ev, "hashes", ()))
        return
    fast, careful, fast_counts, careful_counts = _both(payload)
    _same(fast, careful)
    assert fast_counts == careful_counts


def test_token_ids_are_read_only_when_asked_for_or_for_a_root() -> None:
    ev = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": 7, "block_size": 16,
          "token_ids": list(range(32))}
    for payload in (msgpack.packb([1.0, [ev, ev], 0]), msgpack.packb([1.0, [["BlockStored", [3], 2, list(range(32)), 16]] * 2])):
        lean = kvcodec.decode_batch(payload, "w", 0)
        full = kvcodec.decode_batch(payload, "w", 0, token_ids=True)
        assert [e.token_count for e in lean.events] == [32, 32] and [e.token_ids for e in lean.events] == [(), ()]
        assert [e.token_ids for e in full.events] == [tuple(range(32))] * 2
    big = msgpack.packb([1.0, [{**ev, "token_ids": list(range(70000))}], 0])  # a 32-bit array header
    assert kvcodec.decode_batch(big, "w", 0).events[0].token_count == 70000
    # a root store (no parent) opens a prompt: its tokens are read for prefix instability
    root = msgpack.packb([1.0, [{**ev, "parent_block_hash": None}, ev], 0])
    assert [e.token_ids for e in kvcodec.decode_batch(root, "w", 0).events] == [tuple(range(32)), ()]


def test_the_benchmark_stream_decodes_alike_on_both_paths() -> None:
    data, _ = payloads(n_batches=50)
    for seq, payload in enumerate(data):
        assert kvcodec._typed(payload, "w", seq, True) is not None  # the common case takes the typed path
        _same(kvcodec.decode_batch(payload, "w", seq, token_ids=True), kvcodec.decode_careful(payload, "w", seq))


@SETTINGS
@given(batch(), st.booleans())
def test_the_compiled_event_builder_equals_the_python_one(obj: list, token_ids: bool) -> None:
    payload = msgpack.packb(obj, use_bin_type=True)
    for decode in kvcodec._TYPED:
        try:
            structs = decode(payload).events
        except Exception:
            continue
        want = kvcodec._build_events_py(structs, token_ids)
        got = kvcodec._build_events(structs, token_ids)
        assert [type(e) for e in got] == [type(e) for e in want] and got == want
        assert [getattr(e, "token_ids", None) for e in got] == [getattr(e, "token_ids", None) for e in want]


# ---- the compiled reader (``_prefix_core.scan_kv_batch``) against the typed path ---------------------

def _scanned_agrees(payload: bytes) -> bool:
    """When the compiled reader reads a payload, the typed path reads the same batch; True if it read it."""
    scan = kvcodec._scan(payload) if kvcodec._scan is not None else None
    if scan is None:
        return False
    typed = kvcodec._typed(payload, "w", 5, False)
    assert typed is not None  # a strict subset of what the typed path reads
    assert (scan.ts, scan.dp_rank) == (typed.ts, typed.dp_rank)
    assert scan.events(BlockStored, BlockRemoved, AllBlocksCleared()) == typed.events
    assert scan.sessions == typed.sessions
    assert [e.token_count for e in scan.events(BlockStored, BlockRemoved, AllBlocksCleared()) if type(e) is BlockStored] \
        == [e.token_count for e in typed.events if type(e) is BlockStored]
    roots = [e for e in typed.events if type(e) is BlockStored and e.parent is None]
    assert scan.roots == len(roots)
    got = scan.root_events(BlockStored, COMPARED_BLOCKS)  # cut where prefix instability stops comparing
    assert [(e.hashes, e.parent, e.block_size, e.token_count, e.medium, e.token_ids) for e in got] == \
        [(e.hashes[:COMPARED_BLOCKS], None, e.block_size, e.token_count, e.medium,
          e.token_ids[:COMPARED_BLOCKS * e.block_size]) for e in roots]
    if ROOT_KEYS:  # prefix instability's reading of the roots, computed from the payload
        assert scan.root_keys(COMPARED_BLOCKS, EARLY_SPAN_BLOCKS, MIN_SHARED_BLOCKS) == \
            [root_key(e) for e in roots if e.hashes and is_gpu(e.medium)]
    assert scan.block_size == next((e.block_size for e in typed.events if type(e) is BlockStored and e.block_size), None)
    batch = kvcodec.decode_batch(payload, "w", 5)
    assert type(batch) is kvcodec.ScannedBatch and batch == typed and typed == batch and hash(batch) == hash(typed)
    assert batch.events == typed.events and pickle.loads(pickle.dumps(batch)) == typed
    built = kvcodec.ScannedBatch.of(scan, "w", 5)  # what the reader builds in C, in Python
    assert (built.worker, built.seq, built.ts, built.dp_rank) == (batch.worker, batch.seq, batch.ts, batch.dp_rank)
    assert built == batch and batch.scan is not None and built.scan is scan
    return True


@SETTINGS
@given(batch())
def test_the_compiled_reader_reads_what_the_typed_path_reads(obj: list) -> None:
    _scanned_agrees(msgpack.packb(obj, use_bin_type=True))


@SETTINGS
@given(batch(), st.data())
def test_damaged_payloads_the_compiled_reader_accepts_read_alike(obj: list, data: st.DataObject) -> None:
    payload = bytearray(msgpack.packb(obj, use_bin_type=True))
    for _ in range(data.draw(st.integers(1, 3))):
        payload[data.draw(st.integers(0, len(payload) - 1))] = data.draw(st.integers(0, 255))
    _scanned_agrees(bytes(payload[:data.draw(st.integers(0, len(payload)))]))


def test_the_compiled_reader_takes_the_common_batches_and_leaves_the_rest() -> None:
    if kvcodec._scan is None:
        pytest.skip("the compiled core is not in use")
    data, _ = payloads(n_batches=200)
    assert all(_scanned_agrees(p) for p in data)  # the benchmark's stream: every batch scanned
    stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "block_size": 16,
              "token_ids": list(range(40)), "medium": "GPU"}
    read = [
        [1.5, [["BlockStored", [1, 2], 9, [1, 2], 16, None, "CPU"], ["BlockRemoved", [2]], ["AllBlocksCleared"]], None],
        [1.5, [stored, {"type": "BlockRemoved", "block_hashes": [2**64 - 1], "medium": None, "x": {"y": [1]}}]],
        [1.5, [{**stored, "token_ids": None}, {**stored, "token_ids": list(range(70000))}], 2**63],
        [1.5, [], -3],
        [1.5, [["BlockRemoved", [2], "GPU", 7]]],  # fields appended by later releases (group_idx, …)
        # vLLM 0.23's array event: lora_name, extra_keys, group_idx, kv_cache_spec_kind, sliding window
        [1.5, [["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", None, [None, None], 0,
                "full_attention", None], ["BlockRemoved", [1], "GPU", 0, None, None]], 0],
    ]
    left = [
        [1, [stored]],  # an int timestamp
        [float("inf"), [stored]],
        [1.5, [stored], 0, "extra"],
        [1.5, [{"block_hashes": [1], "type": "BlockRemoved"}]],  # type not first
        [1.5, [stored, ["BlockRemoved", [2]]]],  # mixed encodings
        [1.5, [{**stored, "block_hashes": [b"\x01" * 8]}]],  # bytes hashes
        [1.5, [{**stored, "token_ids": [1, "x"]}]],  # a root's tokens that are not all ints
        [1.5, [{**stored, "medium": f"m{i}"} for i in range(9)]],  # nine media
        [1.5, [{"type": "Nope"}]],
    ]
    for obj in read:
        assert _scanned_agrees(msgpack.packb(obj)), obj
        assert not kvcodec._scan(msgpack.packb(obj)).labelled, obj
    for obj in left:
        assert kvcodec._scan(msgpack.packb(obj)) is None, obj
    deep: list = [1]
    for _ in range(40):
        deep = [deep]
    nested = msgpack.packb([1.5, [{**stored, "x": deep}]])
    assert kvcodec._scan(nested) is None  # nested deeper than the reader follows
    assert kvcodec.decode_batch(nested, "w", 0) == kvcodec._typed(nested, "w", 0, False)


def test_a_batch_with_an_adapter_or_a_salt_takes_the_typed_path_when_attribution_is_on() -> None:
    if kvcodec._scan is None:
        pytest.skip("the compiled core is not in use")
    stored = {"type": "BlockStored", "block_hashes": [1, 2], "parent_block_hash": None, "block_size": 16,
              "token_ids": list(range(32)), "medium": "GPU", "lora_name": None, "extra_keys": [None, None]}
    labelled = [
        [1.5, [{**stored, "lora_name": "sql-adapter"}]],
        [1.5, [{**stored, "extra_keys": [["tenant-a"], None]}]],
        [1.5, [["BlockStored", [1, 2], None, list(range(32)), 16, 3, "GPU", "sql-adapter", None, 0]]],
        [1.5, [["BlockStored", [1, 2], None, list(range(32)), 16, None, "GPU", None, [None, ["tenant-a"]]]]],
    ]
    for obj in labelled:
        payload = msgpack.packb(obj)
        assert kvcodec._scan(payload).labelled, obj
        assert type(kvcodec.decode_batch(payload, "w", 0)) is kvcodec.ScannedBatch  # attribution off: scanned
        with_labels = kvcodec.decode_batch(payload, "w", 0, attribution=True)
        assert type(with_labels) is kvcodec.KvBatch and with_labels.label_events, obj
    plain = kvcodec.decode_batch(msgpack.packb([1.5, [stored]]), "w", 0, attribution=True)
    assert type(plain) is kvcodec.ScannedBatch and plain.attributed and plain.label_events is None
    assert not kvcodec.decode_batch(msgpack.packb([1.5, [stored]]), "w", 0).attributed


# ---- prefix instability's root keys, computed by the compiled reader ---------------------------------

any_int = st.integers(-(2**63), MASK64)
token = st.one_of(st.integers(0, 128000), any_int, st.sampled_from([-1, -2, 2**61 - 1, 2**61, -(2**61 - 1), 0]))


@SETTINGS
@given(st.lists(any_int, max_size=64), any_int.filter(lambda d: d < 2**63))
def test_the_compiled_hash_of_ints_is_pythons(items: list, digest: int) -> None:
    if not ROOT_KEYS:
        pytest.skip("the compiled core is not in use")
    from exporter.core.index._prefix_core import hash_ints, hash_pair

    t = tuple(items)
    assert hash_ints(t) == hash(t)
    assert hash_pair(hash(t), digest) == hash((t, digest))


@st.composite
def root_store(draw: st.DrawFn) -> dict:
    bs = draw(st.sampled_from([1, 2, 3, 16, 32]))
    n = draw(st.integers(0, COMPARED_BLOCKS + 3))
    ev: dict = {"type": "BlockStored", "block_hashes": draw(st.lists(good_hash, min_size=n, max_size=n)),
                "parent_block_hash": None if draw(st.integers(0, 3)) else draw(good_hash), "block_size": bs,
                "medium": draw(good_medium)}
    shape = draw(st.integers(0, 3))
    if shape == 0:  # a long opening: every key computed
        ev["token_ids"] = draw(st.lists(token, min_size=n * bs, max_size=n * bs + bs))
    elif shape == 1:  # fewer tokens than blocks
        ev["token_ids"] = draw(st.lists(token, max_size=max(0, n * bs - 1)))
    elif shape == 2:
        ev["token_ids"] = None
    return ev


@SETTINGS
@given(st.lists(root_store(), max_size=4))
def test_the_compiled_reader_computes_the_root_keys_the_tracker_would(events: list) -> None:
    payload = msgpack.packb([1.9e9, events, 0])
    if kvcodec._scan is None or not ROOT_KEYS:
        pytest.skip("the compiled core is not in use")
    assert _scanned_agrees(payload)
