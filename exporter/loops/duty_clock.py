"""What the exporter's own work costs, by duty: CPU seconds and wall time per batch of work.

Each thread that does a duty's work wraps one batch of it (a drained poll of KV events, a
scrape round, a records body, a /metrics render, a statistics reading, a breach evaluation)
in ``with duties.duty("scrape"):``. The block's ``time.thread_time()`` difference is the CPU
that thread spent on the batch; its ``time.perf_counter()`` difference the wall time. Both
are added to the duty's totals (``prefixscope_exporter_duty_cpu_seconds_total`` and the
``prefixscope_exporter_duty_seconds`` histogram, rendered by ``exporter.web.process_metrics``).

Why per batch and thread CPU: a thread's CPU clock counts only that thread, so work of other
threads running meanwhile (the GIL hands over mid-batch) is not charged to this duty, and the
clock is read twice per batch, never per event. Blocks of one thread do not nest (a nested
block would count its CPU twice), so the sum over duties stays at most the process's CPU.

The totals sit behind one lock taken for a few additions per batch; there is no global
instance: the runtime owns one and hands it to the parts that do the work.
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from prefixscope.catalog import DUTY_BUCKETS, DUTY_NAMES

Duty = Literal["kv_ingest", "scrape", "records", "otlp", "render", "tree_statistics", "breach"]
DUTIES: tuple[Duty, ...] = ("kv_ingest", "scrape", "records", "otlp", "render", "tree_statistics", "breach")
if DUTIES != DUTY_NAMES:  # the catalogue documents the label's values
    raise ImportError(f"duties {DUTIES} differ from the catalogue's {DUTY_NAMES}")


@dataclass(frozen=True)
class DutyTotals:
    """One reading of every duty: CPU seconds and the wall-time histogram row
    ([per-bucket counts..., +Inf count, sum]) per duty, in ``DUTIES`` order."""

    cpu: dict[str, float]
    wall: dict[str, list[float]]


class _Timed:
    """One timed block of one duty (a fresh object per block: threads time their own)."""

    __slots__ = ("_clock", "_cpu", "_index", "_wall")

    def __init__(self, clock: DutyClock, index: int) -> None:
        self._clock = clock
        self._index = index
        self._cpu = 0.0
        self._wall = 0.0

    def __enter__(self) -> None:
        c = self._clock
        self._wall = c.wall_time()
        self._cpu = c.thread_time()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        c = self._clock
        cpu = c.thread_time() - self._cpu
        c.add(self._index, cpu, c.wall_time() - self._wall)


class DutyClock:
    """CPU and wall time per duty, summed over every thread and batch since start."""

    def __init__(self, thread_time: Callable[[], float] = time.thread_time,
                 wall_time: Callable[[], float] = time.perf_counter,
                 buckets: tuple[float, ...] = DUTY_BUCKETS) -> None:
        self.thread_time = thread_time
        self.wall_time = wall_time
        self.buckets = buckets
        self._index = {d: i for i, d in enumerate(DUTIES)}
        self._lock = threading.Lock()
        self._cpu = [0.0] * len(DUTIES)
        # per duty: bucket counts (non-cumulative, +Inf last), then the sum of the wall times
        self._wall = [[0.0] * (len(buckets) + 2) for _ in DUTIES]

    def duty(self, name: Duty) -> _Timed:
        """A context manager timing one batch of ``name``'s work on the calling thread."""
        return _Timed(self, self._index[name])

    def wrap(self, name: Duty, fn: Callable[..., object]) -> Callable[..., object]:
        """``fn`` with each call timed as one batch of ``name`` (for callbacks handed elsewhere)."""
        index = self._index[name]

        def timed(*args: object, **kwargs: object) -> object:
            with _Timed(self, index):
                return fn(*args, **kwargs)
        return timed

    def add(self, index: int, cpu: float, wall: float) -> None:
        bucket = bisect_left(self.buckets, wall)  # le-buckets: a value on a bound counts in it
        with self._lock:
            self._cpu[index] += max(cpu, 0.0)
            row = self._wall[index]
            row[bucket] += 1.0
            row[-1] += wall

    def totals(self) -> DutyTotals:
        with self._lock:
            cpu = list(self._cpu)
            wall = [list(r) for r in self._wall]
        return DutyTotals(cpu=dict(zip(DUTIES, cpu, strict=True)), wall=dict(zip(DUTIES, wall, strict=True)))
