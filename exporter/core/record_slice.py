"""The per-record work of one slice of request records, the loop in one place.

``ClusterState.ingest_records`` takes the state lock and the store's batch once per slice and
hands the slice to :func:`apply_records`: each record is accounted (``RecordAccounting.account``:
labels, signals, the reuse decomposition, the index's hits, sessions, cold prefill, miss cost …),
attributed to its adapter and tenant, and its reused blocks count as hits for the eviction
tracker; the workers it names are sorted into those whose pool state it cannot change and those
the pool must judge once the slice is in.

``exporter.core._records_core`` (Cython, built by ``pip install``) does the same work with the
common steps compiled and the small writes they make (counters held back for the batch, histogram
observations, session turns and their anchors, hit history) inlined; :func:`reference_apply_records`
is the definition, and tests apply randomized record streams through both and compare every
series, window, session and API answer. :data:`CORE` says which one is in use
(``PREFIXSCOPE_RECORDS=reference`` picks the reference).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from exporter.core.attribution import RecordAttribution
from exporter.core.health import Health
from exporter.core.index.prefix_index import EvictionTracker
from exporter.core.record_accounting import RecordAccounting, count_unprocessable
from exporter.core.worker_pool import WorkerPool
from prefixscope.records import RequestRecord

log = logging.getLogger("prefixscope.records")

__all__ = ["CORE", "RecordInput", "apply_records", "reference_apply_records"]

RecordInput = RequestRecord | Mapping[str, Any]
ApplyRecords = Callable[[RecordAccounting, RecordAttribution, EvictionTracker, WorkerPool, Health, Iterable[RecordInput],
                         float, set[str], set[str]], None]


def reference_apply_records(accounting: RecordAccounting, attribution: RecordAttribution, evictions: EvictionTracker,
                            pool: WorkerPool, health: Health, records: Iterable[RecordInput], now: float,
                            unchanged: set[str], judge: set[str]) -> None:
    """Account each record (the caller holds the state lock and the store's batch) and sort the
    workers they name into ``unchanged`` (the pool cannot change for them) and ``judge``.

    A plain JSON object (replays, tests, the lab) is converted here; one that cannot be, or a
    record that fails half-way, is counted as ``unprocessable`` and skipped."""
    account, attribute = accounting.account, attribution.account
    for rec in records:
        try:
            record = rec if isinstance(rec, RequestRecord) else RequestRecord.from_json(rec)
            worker = account(record)
            attribute(record, now)
            if record.block_hashes and record.cached_tokens:  # reuse seen on that worker
                hit = record.cached_tokens // pool.worker_block_size(record.worker)
                evictions.hits(record.worker, record.block_hashes[:hit])
        except (TypeError, ValueError, KeyError) as exc:  # InvalidRecord is a ValueError
            # Schema-valid records should not fail here; if one does, keep the rest.
            count_unprocessable(health, rec, exc)
            continue
        if worker not in unchanged:
            (unchanged if pool.unchanged_for(worker) else judge).add(worker)


apply_records: ApplyRecords
_WANT = os.environ.get("PREFIXSCOPE_RECORDS", "").strip().lower()
try:
    if _WANT == "reference":
        raise ImportError("PREFIXSCOPE_RECORDS=reference")
    from exporter.core._records_core import apply_records as _compiled_apply_records
except ImportError as exc:
    apply_records = reference_apply_records
    CORE = "reference"
    (log.info if _WANT == "reference" else log.warning)(
        "records: the Python reference of the per-record work (compiled core not used: %s)", exc)
else:
    apply_records = _compiled_apply_records
    CORE = "compiled"
