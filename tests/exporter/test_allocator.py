"""The exporter caps glibc's arenas and trims freed memory (no-ops without glibc)."""

from __future__ import annotations

import platform

from exporter import allocator


def test_arenas_are_capped_and_trim_runs_where_glibc_is() -> None:
    glibc = platform.libc_ver()[0] == "glibc"
    assert allocator.limit_arenas() is glibc
    allocator.trim()  # returns whether memory went back; it must not fail either way
