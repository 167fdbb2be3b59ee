"""The compiled OTLP wire walk against the Python reference: the same counts or the same error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.codecs import otlp

pytestmark = pytest.mark.skipif(otlp.CORE != "compiled", reason="the compiled walk is not built")

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
BUDGETS = [otlp.Budget(), otlp.Budget(max_spans=3, max_items=10_000), otlp.Budget(max_spans=10_000, max_items=40)]


def _outcome(walk, body: bytes, budget: otlp.Budget) -> tuple:  # type: ignore[no-untyped-def]
    try:
        return ("ok", walk(body, budget))
    except otlp.OtlpDecodeError as exc:
        return (type(exc).__name__, str(exc))


def check(body: bytes) -> None:
    for budget in BUDGETS:
        assert _outcome(otlp.count_protobuf, body, budget) == _outcome(otlp.count_protobuf_reference, body, budget), body


def _bodies() -> list[bytes]:
    from bench.otlp import export_body

    rng = random.Random(3)
    return [(FIXTURES / "sglang_router_spans.binpb").read_bytes(), export_body(rng, "w0", 1.7e9)]


def test_real_bodies_count_the_same() -> None:
    for body in _bodies():
        check(body)
        assert otlp.count_protobuf(body, otlp.Budget())[0] > 0


def test_mutated_and_truncated_bodies_fail_the_same_way() -> None:
    rng = random.Random(11)
    for body in _bodies():
        for _ in range(400):
            b = bytearray(body[:rng.randrange(len(body) + 1)] if rng.random() < 0.3 else body)
            for _ in range(rng.randint(1, 6)):
                if b:
                    b[rng.randrange(len(b))] = rng.randrange(256)
            check(bytes(b))


@pytest.mark.parametrize("body", [
    b"", b"\x0a", b"\x0a\x05", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"\xff\xff\xff\xff\xff\xff\xff\xff\xff\x7f\x00", b"\x0b", b"\x09" + b"\x00" * 7, b"\x0d\x00\x00\x00\x00",
    b"\x0a\x00" * 20, b"\x0a\x02\x12\x00" * 5,
])
def test_edge_bodies(body: bytes) -> None:
    check(body)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_generated_bytes(body: bytes) -> None:
    check(body)
