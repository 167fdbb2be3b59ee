"""RequestRecord: the typed prefixscope.request/v1 record, built from valid and invalid objects."""

from dataclasses import FrozenInstanceError, fields

import pytest

from prefixscope.records import SCHEMA, InvalidRecord, RequestRecord

GOOD = {"ts": 100, "request_id": "r1", "worker": "w0", "prompt_tokens": 512}


def test_fields_are_the_schema_properties() -> None:
    names = {f.name for f in fields(RequestRecord)} - {"carried"}
    assert names == set(SCHEMA["properties"])
    assert RequestRecord.__slots__  # slotted: no per-record __dict__


def test_required_only_leaves_the_optional_fields_none() -> None:
    r = RequestRecord.parse(GOOD)
    assert (r.ts, r.request_id, r.worker, r.prompt_tokens) == (100.0, "r1", "w0", 512)
    assert isinstance(r.ts, float)
    assert all(getattr(r, f.name) is None for f in fields(r) if f.name not in (*SCHEMA["required"], "carried"))
    assert r.carried == frozenset()
    with pytest.raises(FrozenInstanceError):
        r.worker = "w1"  # type: ignore[misc]


def test_values_are_converted_to_their_types() -> None:
    r = RequestRecord.from_json({**GOOD, "prompt_tokens": 512.0, "block_hashes": [1, 2**64 - 1], "cached_tokens": 256.0,
                                 "prefill_s": 1, "admitted_by_affinity": False, "segment": "web", "extra": "ignored"})
    assert r.prompt_tokens == 512 and type(r.prompt_tokens) is int
    assert r.block_hashes == (1, 2**64 - 1)
    assert r.cached_tokens == 256 and type(r.cached_tokens) is int
    assert r.prefill_s == 1.0 and type(r.prefill_s) is float
    assert r.admitted_by_affinity is False and r.segment == "web"
    assert not hasattr(r, "extra")


def test_explicit_null_is_remembered_for_event_fields() -> None:
    said_none = RequestRecord.from_json({**GOOD, "migrated_from": None})
    silent = RequestRecord.from_json(GOOD)
    moved = RequestRecord(1.0, "r", "w1", 10, migrated_from="w0")
    assert said_none.reports("migrated_from") and not silent.reports("migrated_from")
    assert moved.reports("migrated_from") and not moved.reports("async_wait_s")


@pytest.mark.parametrize(("obj", "needle"), [
    ({k: v for k, v in GOOD.items() if k != "worker"}, "worker"),
    ({**GOOD, "prompt_tokens": -1}, "prompt_tokens"),
    ({**GOOD, "ts": "yesterday"}, "ts"),
    ({**GOOD, "migration_kind": "teleport"}, "migration_kind"),
    ({**GOOD, "block_hashes": [2**64]}, "block_hashes"),
    ([1, 2], "object"),
])
def test_parse_rejects_what_the_schema_rejects(obj: object, needle: str) -> None:
    with pytest.raises(InvalidRecord) as info:
        RequestRecord.parse(obj)
    assert needle in str(info.value)


def test_from_json_trusts_the_schema_but_not_a_missing_or_unconvertible_field() -> None:
    with pytest.raises(InvalidRecord, match="'prompt_tokens'"):
        RequestRecord.from_json({"ts": 1, "request_id": "r", "worker": "w"})
    with pytest.raises(InvalidRecord, match="r1"):
        RequestRecord.from_json({**GOOD, "ts": "yesterday"})
    with pytest.raises(InvalidRecord, match="object"):
        RequestRecord.from_json([1, 2])  # type: ignore[arg-type]
    assert issubclass(InvalidRecord, ValueError)
