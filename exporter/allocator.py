"""glibc's allocator, told what a long-running exporter needs.

glibc gives threads that allocate at once arenas of their own (up to eight per core), and memory
freed in an arena stays with the process. The exporter's threads (scrapes, KV subscribers, one per
HTTP connection, the statistics pass) each come to hold an arena, so RSS grows in steps long after
what the exporter holds has stopped growing, and a 2-core soak measured half of RSS as arenas. Two
arenas are plenty for a process whose work is serialised by one state lock; the freed tops of the
heaps go back to the OS on a periodic trim. Elsewhere (musl, macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("prefixscope.allocator")

M_ARENA_MAX = -8  # mallopt parameter (malloc.h)
ARENAS = 2
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
