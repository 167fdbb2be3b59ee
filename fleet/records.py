"""Request records (``prefixscope.request/v1``): validation and the two ways out.

- :class:`FileSink` appends NDJSON to a file (the exporter tails it).
- :class:`HttpSink` POSTs NDJSON batches to a URL (the exporter's ``/api/v1/records``) from a
  background thread: a bounded buffer, batching, retry with exponential backoff. Routing never
  blocks on it — when the buffer is full the oldest records are dropped and counted.
- :class:`ListSink` keeps records in memory (the accelerated simulation and tests).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from functools import cache
from pathlib import Path
from typing import Protocol

import requests
from jsonschema import Draft202012Validator

from prefixscope import REQUEST_SCHEMA_PATH

log = logging.getLogger("prefixscope.fleet.records")

SCHEMA_NAME = "prefixscope.request/v1"
SCHEMA_PATH = REQUEST_SCHEMA_PATH


@cache
def validator() -> Draft202012Validator:
    return Draft202012Validator(json.loads(SCHEMA_PATH.read_text(encoding="utf-8")))


def schema_errors(record: dict) -> list[str]:
    """Readable schema violations of one record (empty when it is valid)."""
    return [f"{'.'.join(str(p) for p in e.absolute_path) or '(record)'}: {e.message}"
            for e in validator().iter_errors(record)]


def to_ndjson(records: Iterable[dict]) -> bytes:
    return b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)


class RecordSink(Protocol):
    def emit(self, record: dict) -> None: ...

    def close(self) -> None: ...


class ListSink:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def emit(self, record: dict) -> None:
        self.records.append(record)

    def close(self) -> None:
        pass


class FileSink:
    """Append one JSON line per record; flushed per batch so a tailing reader sees whole lines."""

    def __init__(self, path: str | Path, flush_every: int = 64) -> None:
        self.path = Path(path)
        self._fh = self.path.open("ab")
        self._pending = 0
        self._flush_every = flush_every
        self._lock = threading.Lock()

    def emit(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            self._fh.write(line)
            self._pending += 1
            if self._pending >= self._flush_every:
                self._fh.flush()
                self._pending = 0

    def flush(self) -> None:
        with self._lock:
            self._fh.flush()
            self._pending = 0

    def close(self) -> None:
        with self._lock:
            if not self._fh.closed:
                self._fh.flush()
                self._fh.close()


class HttpSink:
    """Batched NDJSON POSTs on a background thread; ``emit`` never blocks on the network."""

    def __init__(self, url: str, *, batch_size: int = 500, flush_interval_s: float = 0.5,
                 max_buffer: int = 50000, max_retries: int = 5, backoff_s: float = 0.2,
                 timeout_s: float = 5.0, token: str | None = None) -> None:
        self.url = url
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self._headers = {"Content-Type": "application/x-ndjson"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._buf: deque[dict] = deque(maxlen=max_buffer)
        self._cond = threading.Condition()
        self._closing = False
        self.sent = 0
        self.dropped = 0  # records lost: buffer overflow or retries exhausted
        self.failed_posts = 0
        self._session = requests.Session()
        self._thread = threading.Thread(target=self._run, name="prefixscope-records", daemon=True)
        self._thread.start()

    def emit(self, record: dict) -> None:
        with self._cond:
            if len(self._buf) == self._buf.maxlen:
                self.dropped += 1  # deque drops the oldest
            self._buf.append(record)
            if len(self._buf) >= self.batch_size:
                self._cond.notify()

    def _take(self) -> list[dict]:
        with self._cond:
            if not self._buf and not self._closing:
                self._cond.wait(self.flush_interval_s)
            n = min(self.batch_size, len(self._buf))
            return [self._buf.popleft() for _ in range(n)]

    def _post(self, batch: list[dict]) -> None:
        body = to_ndjson(batch)
        delay = self.backoff_s
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._session.post(self.url, data=body, headers=self._headers, timeout=self.timeout_s)
                if resp.status_code < 500 and resp.status_code != 429:
                    if resp.status_code >= 400:
                        # The receiver rejected the batch itself; retrying cannot help.
                        log.warning("record sink %s answered %s: %s", self.url, resp.status_code, resp.text[:200])
                        self.dropped += len(batch)
                    else:
                        self.sent += len(batch)
                    return
                problem = f"HTTP {resp.status_code}"
            except requests.RequestException as exc:
                problem = str(exc)
            self.failed_posts += 1
            if attempt == 0:
                log.warning("record sink %s: %s; retrying with backoff", self.url, problem)
            if attempt == self.max_retries:
                break
            time.sleep(delay)
            delay = min(delay * 2, 5.0)
        self.dropped += len(batch)

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch:
                self._post(batch)
            with self._cond:
                if self._closing and not self._buf:
                    return

    def close(self, timeout_s: float = 10.0) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout_s)
        self._session.close()


class MultiSink:
    def __init__(self, sinks: Iterable[RecordSink]) -> None:
        self.sinks = list(sinks)

    def emit(self, record: dict) -> None:
        for s in self.sinks:
            s.emit(record)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
