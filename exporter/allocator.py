"""glibc's allocator, told what a long-running exporter needs.

glibc gives threads that allocate at once arenas of their own (up to eight per core), and memory
freed in an arena stays with the process. The exporter's threads (scrapes, KV subscribers, one per
HTTP connection, the statistics pass) each come to hold an arena, so RSS grows in steps long after
what the exporter holds has stopped growing, and a 2-core soak measured half of RSS as arenas. Two
arenas are plenty for a process whose work is serialised by one state lock; the freed tops of the
heaps go back to the OS on a periodic trim. Blocks of up to 32 MB come from the heaps rather than
mappings of their own (``heap_large_blocks``), so what a /metrics scrape writes and drops reuses
the pages of the previous scrape. Elsewhere (musl, macOS) all of it is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("prefixscope.allocator")

M_ARENA_MAX = -8  # mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
ARENAS = 2
MMAP_THRESHOLD = 32 << 20  # the most glibc accepts on 64-bit: larger blocks still get mappings of their own
TRIM_THRESHOLD = 64 << 20  # a freed heap top kept up to this size between the periodic trims
TRIM_EVERY_S = 60.0  # how often the exporter's main loop returns freed memory


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None


_LIBC = _libc()


def limit_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's arenas; call before the threads start. False where there is no glibc."""
    if _LIBC is None:
        return False
    ok = bool(_LIBC.mallopt(M_ARENA_MAX, arenas))
    log.debug("malloc arenas capped at %d: %s", arenas, ok)
    return ok


def trim() -> bool:
    """Return the free tops of the heaps to the OS (``malloc_trim(0)``); False when nothing was."""
    return bool(_LIBC.malloc_trim(0)) if _LIBC is not None else False


def heap_large_blocks(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Serve blocks up to ``mmap_threshold`` bytes from the heaps, and give a freed heap top back to
    the OS only past ``trim_threshold`` (or at the periodic :func:`trim`). False where there is no
    glibc.

    A /metrics scrape at 1,000 workers writes a text of ~5 MB and drops it when sent. glibc maps a
    block of that size afresh, and unmaps it when freed, whenever it is larger than every block
    freed before — and the page grows with its counters, so nearly every scrape's text was a new
    mapping whose ~1,300 pages faulted in as they were written (~2 ms of CPU, a tenth of the
    scrape). From the heap, the next scrape's text reuses the last one's pages.
    """
    if _LIBC is None:
        return False
    ok = bool(_LIBC.mallopt(M_MMAP_THRESHOLD, mmap_threshold)) and bool(_LIBC.mallopt(M_TRIM_THRESHOLD, trim_threshold))
    log.debug("malloc: blocks up to %d B from the heaps, tops kept up to %d B: %s", mmap_threshold, trim_threshold, ok)
    return ok
