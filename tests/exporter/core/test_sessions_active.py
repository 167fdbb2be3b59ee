"""The window's sessions as the table keeps them apart: the same sessions, in the same order,
as a scan of the whole table, whatever order records arrive in."""

from __future__ import annotations

import random

from exporter.core.sessions import SessionTable


def _scan(table: SessionTable, cutoff: float) -> list[str]:
    return [s.key for s in table.sessions() if s.last_ts > cutoff]


def test_active_sessions_match_a_scan_of_the_table() -> None:
    rng = random.Random(1)
    table = SessionTable(max_sessions=150)
    now, window = 0.0, 30.0
    for step in range(3000):
        now += rng.random()
        ts = now - rng.choice((0.0, 0.0, rng.random() * 60))  # some late records, some very late
        table.observe(f"s{rng.randrange(400)}", ts, "w0", [rng.randrange(1 << 20)], "a", 0)
        if step % 97 == 0:
            table.expire(now, 120.0)
        if step % 3 == 0:
            cutoff = now - window
            assert [s.key for s in table.active_since(cutoff)] == _scan(table, cutoff)
    # A reader that asks about an earlier window is answered from the whole table.
    assert [s.key for s in table.active_since(now - 100)] == _scan(table, now - 100)


def test_a_read_does_not_walk_the_idle_sessions() -> None:
    """Sessions idle since before the window are left behind once, and not looked at again."""
    table = SessionTable(max_sessions=100_000)
    for i in range(20_000):
        table.observe(f"old{i}", float(i) / 100, "w0", None, "a", 0)
    assert len(table.active_since(150.0)) == 4999
    for i in range(50):
        table.observe(f"new{i}", 1000.0 + i, "w0", None, "a", 0)
    assert len(table.active_since(900.0)) == 50
    assert len(table._active or {}) == 50  # what the next read walks
