"""Property-based checks of the input edges (a small budget here; ``make fuzz`` runs a million)."""

from __future__ import annotations

import math

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.codecs import kvcodec, normalize, promtext
from exporter.core.health import Health
from exporter.core.labels import MAX_LABEL_VALUE_CHARS, valid_label_value
from exporter.model import BlockRemoved, BlockStored

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MASK64 = (1 << 64) - 1

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(2**63), max_value=2**64 - 1),
                    st.floats(allow_nan=True, allow_infinity=True), st.binary(max_size=40), st.text(max_size=12))
msgpack_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=5)
                              | st.dictionaries(st.text(max_size=20), inner, max_size=6), max_leaves=30)
hashes = st.lists(st.one_of(st.integers(min_value=0, max_value=MASK64), st.binary(min_size=1, max_size=32), scalars),
                  max_size=4)
events = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "X"]),
                           "block_hashes": hashes, "block_size": st.one_of(st.just(16), scalars)},
                          optional={"parent_block_hash": scalars, "token_ids": msgpack_values, "medium": scalars}),
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]), hashes, scalars,
              msgpack_values, st.one_of(st.just(16), scalars), scalars, scalars).map(list),
    msgpack_values)
batches = st.tuples(st.one_of(st.floats(), st.integers(min_value=-(2**63), max_value=2**63), scalars),
                    st.lists(events, max_size=5), scalars).map(list)


def _check_batch(payload: bytes) -> None:
    batch = kvcodec.decode_batch(payload, "w", 3, Health())
    if batch is None:
        return
    assert math.isfinite(batch.ts)
    for ev in batch.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= MASK64 for h in ev.hashes)
        if isinstance(ev, BlockStored):
            assert ev.parent is None or 0 <= ev.parent <= MASK64
            assert ev.block_size > 0


@SETTINGS
@given(st.binary(max_size=200))
def test_kv_decoder_never_raises_on_bytes(payload: bytes) -> None:
    _check_batch(payload)


@SETTINGS
@given(batches)
def test_kv_decoder_keeps_only_valid_hashes(batch: list) -> None:
    _check_batch(msgpack.packb(batch, use_bin_type=True))


@SETTINGS
@given(st.text(max_size=400))
def test_text_parser_never_raises_and_passes_only_valid_label_values(text: str) -> None:
    result = promtext.parse(text)
    for samples in result.samples.values():
        for s in samples:
            assert all(valid_label_value(v) for v in s.labels.values())
    try:
        snap, _ = normalize.parse_worker("w", text)
    except normalize.UnrecognisedMetrics:
        return
    assert all(math.isfinite(v) for v in (getattr(snap, f) for f in snap.__slots__) if isinstance(v, float))


label_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True)
label_values = st.text(st.characters(codec="utf-8"), max_size=40)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


@SETTINGS
@given(st.dictionaries(label_names, label_values, max_size=6), st.booleans())
def test_label_blocks_round_trip(labels: dict[str, str], trailing_comma: bool) -> None:
    block = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items()) + ("," if trailing_comma and labels else "")
    assert promtext.parse_labels(block) == labels
    result = promtext.parse(f"m{{{block}}} 1\n")
    assert result.errors == [] and result.values("m")[0].labels == labels


@SETTINGS
@given(label_names, st.one_of(st.text(min_size=MAX_LABEL_VALUE_CHARS + 1, max_size=MAX_LABEL_VALUE_CHARS + 50),
                              st.text(max_size=5).map(lambda t: t + "\ud800")))
def test_unusable_label_values_reject_the_line_only(name: str, value: str) -> None:
    result = promtext.parse(f'm{{{name}="{_escape(value)}"}} 1\nm 2\n')
    assert [s.value for s in result.values("m")] == [2.0]
    assert [(e.line, e.kind) for e in result.errors] == [(1, "label_value")]
