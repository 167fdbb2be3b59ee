"""The window's sessions as the table keeps them apart: the same sessions (and hit ratios), in the same order,
as a scan of the whole table, whatever order records arrive in."""

from __future__ import annotations

import random

from exporter.core.sessions import SessionTable


def _scan(table: SessionTable, cutoff: float) -> list[str]:
    return [s.key for s in table.sessions() if s.last_ts > cutoff]


def _ratios(table: SessionTable, cutoff: float) -> list[float]:
    return [s.followup_cached / s.followup_prompt for s in table.sessions()
            if s.last_ts > cutoff and s.followup_prompt > 0]


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
        s = table.get(f"s{rng.randrange(400)}")
        if s is not None:  # follow-up sums, as a record's turn adds them
            s.followup_prompt += rng.choice((0.0, 64.0))
            s.followup_cached += rng.choice((0.0, 16.0))
        if step % 3 == 0:
            cutoff = now - window
            if step % 2:
                assert [s.key for s in table.active_since(cutoff)] == _scan(table, cutoff)
            else:
                assert table.hit_ratios_since(cutoff) == _ratios(table, cutoff)
    # A reader that asks about an earlier window is answered from the whole table.
    assert [s.key for s in table.active_since(now - 100)] == _scan(table, now - 100)
    assert table.hit_ratios_since(now - 110) == _ratios(table, now - 110)
    assert SessionTable().hit_ratios_since(now) == []


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
