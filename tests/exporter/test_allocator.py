"""The exporter caps glibc's arenas, serves large blocks from the heaps and trims freed memory
(no-ops without glibc)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from exporter import allocator

ROOT = Path(__file__).resolve().parents[2]

# What a /metrics scrape does with its text: ~5 MB written, dropped, and ~5 MB again, a little
# larger, at the next scrape. Prints the pages the second one faulted in, and the pages it has.
_SCRAPES = """
import resource, sys
from exporter import allocator
assert allocator.heap_large_blocks() is True
size = 5 << 20
text = b"\\1" * size
del text
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
text = b"\\1" * (size + 100_000)  # written through: every page touched
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, len(text) // resource.getpagesize())
"""


def test_arenas_are_capped_and_trim_runs_where_glibc_is() -> None:
    glibc = platform.libc_ver()[0] == "glibc"
    assert allocator.limit_arenas() is glibc
    allocator.trim()  # returns whether memory went back; it must not fail either way


def test_a_large_block_freed_and_asked_again_larger_reuses_its_pages() -> None:
    """In a process of its own (the setting is the process's): from the heap, the second text's
    pages are the first one's, not a fresh mapping's."""
    if platform.libc_ver()[0] != "glibc":
        assert allocator.heap_large_blocks() is False
        pytest.skip("glibc's allocator only")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _SCRAPES], env=env, capture_output=True, text=True, check=True)
    faults, pages = map(int, out.stdout.split())
    assert faults < pages // 4
