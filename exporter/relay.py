"""``prefixscope relay``: workers' ZMQ KV-event streams → one NATS JetStream stream.

The relay subscribes to each worker's PUB socket (and its replay socket) with the exporter's
ZMQ subscriber (:mod:`exporter.sources.kv_zmq`: the same topic check, gap detection, replays
and restart rule) and publishes every batch it would have applied — the msgpack payload byte
for byte — to ``<prefix>.<worker>`` with the worker's sequence in headers
(:mod:`exporter.codecs.kv_stream`). The stream's retention (``max_age``, ``max_bytes``, oldest
discarded first) is the replay buffer of every consumer that starts later.

What survives what (and what is counted as loss instead):

* **worker gaps** (ZMQ's PUB dropped messages): healed from the worker's replay socket before the
  batch that revealed them, so the stream holds the batches in order; what the worker's buffer
  no longer holds is missing in the stream, and the consumer counts the jump in ``seq`` as
  missed batches;
* **worker restarts** (seq back to 0): the next message carries ``Prefixscope-Restart: 1`` and the
  new process's batches follow from its replay (seq 0 on);
* **NATS restarts / outages**: each worker's batches are published one at a time, in order, each
  retried until JetStream acknowledges it (``Nats-Msg-Id`` makes a retry whose first attempt was
  stored a duplicate that JetStream drops). While NATS is away at most ``max_pending`` batches
  wait in memory; then the ZMQ thread stops reading, the worker's PUB drops under its
  high-water mark, and the gap is healed from the worker's replay socket once NATS is back — so
  nothing is lost that the worker's replay buffer (``buffer_steps``) still holds;
* **relay restarts**: at start the relay reads each worker's last relayed ``seq`` from the stream
  and resumes after it: the first live message at ``seq > last + 1`` is a gap healed from the
  worker's replay (batches ``last + 1 ..``), one at ``seq <= last`` is a restart. A worker the
  stream has never seen is replayed from 0. A worker that restarted while the relay was down and
  already passed its old sequence cannot be told from a gap: its replay is relayed as if it
  continued (the exporter's index keeps the old process's blocks until they are removed or the
  worker restarts again) — vLLM's sequence carries no process identity.

The relay imports only the exporter's KV pieces (never fleet or lab). It holds no index.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import nats
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from exporter.codecs.kv_stream import DEFAULT_PREFIX, DEFAULT_STREAM, H_SEQ, headers_for, subject_for
from exporter.config import ConfigError, WorkerTarget, load_fleet_manifest
from exporter.core.health import Health
from exporter.model import KvStreamSink
from exporter.sources.kv_zmq import KvEndpoint, KvEventSubscriber
from prefixscope.durations import seconds
from prefixscope.validation import Problems, read_yaml

log = logging.getLogger("prefixscope.relay")

SCHEMA_FILE = "relay-config.v1.json"
DEFAULT_MAX_AGE_S = 3600.0
DEFAULT_MAX_BYTES = 1 << 30
DEFAULT_MAX_PENDING = 50_000
DUPLICATE_WINDOW_S = 120.0  # JetStream's default; capped at max_age


@dataclass(frozen=True)
class RelayConfig:
    nats_url: str = "nats://127.0.0.1:4222"
    stream: str = DEFAULT_STREAM
    subject_prefix: str = DEFAULT_PREFIX
    max_age_s: float = DEFAULT_MAX_AGE_S
    max_bytes: int = DEFAULT_MAX_BYTES
    max_pending: int = DEFAULT_MAX_PENDING
    replay_timeout: float = 2.0
    workers: tuple[WorkerTarget, ...] = ()


def parse_relay_config(raw: Any, source: str = "<relay config>", base_dir: Path | None = None) -> RelayConfig:
    """The relay's YAML (``prefixscope/schemas/relay-config.v1.json``, then the checks that span
    fields and the manifest it names; docs/operating.md); every problem at once as a ConfigError."""
    problems = Problems(source)
    problems.check_schema(raw, SCHEMA_FILE)
    d: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    n, r = _section(d, "nats"), _section(d, "retention")
    workers = [WorkerTarget(name=w["name"], kv_events=w["kv_events"], replay=w.get("replay"), topic=w.get("topic") or "")
               for i, w in enumerate(d.get("workers") or []) if not problems.has(f"workers[{i}]")]
    manifest = d.get("fleet_manifest")
    if isinstance(manifest, str) and not problems.has("fleet_manifest"):
        p = Path(manifest)
        p = p if p.is_absolute() else (base_dir or Path.cwd()) / p
        names = {w.name for w in workers}
        try:
            workers += [w for w in load_fleet_manifest(p, source) if w.name not in names and w.kv_events]
        except ConfigError as exc:
            for line in exc.problems:  # already "file: fleet_manifest: problem"
                problems.add("fleet_manifest", line.removeprefix(f"{source}: fleet_manifest: "))
    if not workers and not problems.has("workers"):
        problems.add("workers", "no worker with kv_events to relay")
    problems.raise_if_any(ConfigError)
    return RelayConfig(nats_url=n.get("url", RelayConfig.nats_url), stream=n.get("stream", DEFAULT_STREAM),
                       subject_prefix=n.get("subject_prefix", DEFAULT_PREFIX),
                       max_age_s=seconds(r.get("max_age", DEFAULT_MAX_AGE_S)),
                       max_bytes=r.get("max_bytes", DEFAULT_MAX_BYTES),
                       max_pending=d.get("max_pending", DEFAULT_MAX_PENDING),
                       replay_timeout=seconds(d.get("replay_timeout", 2.0)), workers=tuple(workers))


def _section(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key)
    return value if isinstance(value, Mapping) else {}


def load_relay_config(path: str | Path) -> RelayConfig:
    p = Path(path)
    return parse_relay_config(read_yaml(p, p.name, ConfigError), p.name, p.resolve().parent)


class _Restarts:
    """The subscriber's stream sink: the relay forwards payloads itself (it decodes no batch) and
    keeps no view, so of the stream's events it only notes restarts, which the next payload carries."""

    def __init__(self) -> None:
        self.pending: set[str] = set()

    def worker_restarted(self, worker: str) -> None:
        self.pending.add(worker)

    def reset_view(self, worker: str) -> None:
        """A rebuild replays the worker's buffer: the payloads are forwarded as they come."""

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        """The replayed payloads went out; the exporters reading the stream keep the views."""


class _RelaySubscriber(KvEventSubscriber):
    """The ZMQ subscriber with "apply" replaced by "hand the raw payload to the relay"."""

    def __init__(self, relay: Relay, endpoints: Mapping[str, KvEndpoint], resume: Mapping[str, int],
                 sink: KvStreamSink, health: Health, replay_timeout: float) -> None:
        # a stream sink is enough: _decode_and_apply, the one caller of apply_kv_batch, is replaced
        super().__init__(endpoints, sink, health, replay_timeout=replay_timeout)  # type: ignore[arg-type]
        self.relay = relay
        self.resume = dict(resume)

    def _decode_and_apply(self, worker: str, seq: int, payload: bytes, received_at: float) -> None:
        self.relay.forward(worker, seq, payload)

    def _startup_replays(self) -> None:
        """Replay from 0 only workers the stream has never seen; resume the others after their last seq."""
        everyone = self.endpoints
        self.endpoints = {w: ep for w, ep in everyone.items() if w not in self.resume}
        try:
            super()._startup_replays()
        finally:
            self.endpoints = everyone
        for worker, last in self.resume.items():
            self._next[worker] = last + 1


class Relay:
    """``start()`` connects to NATS, ensures the stream, then relays; ``close()`` stops everything."""

    def __init__(self, cfg: RelayConfig, health: Health | None = None) -> None:
        self.cfg = cfg
        self.health = health or Health()
        self.published = 0
        self.retries = 0
        self._restarts = _Restarts()
        self._topics = {w.name: w.topic.encode() for w in cfg.workers}
        self._slots = threading.BoundedSemaphore(cfg.max_pending)
        self._loop = asyncio.new_event_loop()
        self._queues: dict[str, asyncio.Queue[tuple[int, bytes, bool]]] = {}
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._subscriber: _RelaySubscriber | None = None
        self._js: JetStreamContext | None = None
        self._nc: nats.NATS | None = None
        self.resume: dict[str, int] = {}

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self, timeout: float = 30.0) -> Relay:
        """Connect, create or update the stream, read where each worker stopped, start relaying."""
        self._thread = threading.Thread(target=self._loop.run_forever, name="prefixscope-relay-nats", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._setup(), self._loop).result(timeout)
        endpoints = {w.name: KvEndpoint(w.kv_events or "", w.replay, w.topic) for w in self.cfg.workers}
        self._subscriber = _RelaySubscriber(self, endpoints, self.resume, self._restarts, self.health,
                                            self.cfg.replay_timeout)
        self._subscriber.start()
        self._ready.set()
        return self

    def wait_started(self, timeout: float = 30.0) -> bool:
        """True once the ZMQ side has connected and the start-up replays are relayed."""
        return self._ready.is_set() and self._subscriber is not None and self._subscriber.wait_started(timeout)

    def close(self) -> None:
        self._stop.set()
        if self._subscriber is not None:
            self._subscriber.close(timeout=2.0)
        if self._thread is not None and self._thread.is_alive():
            with contextlib.suppress(Exception):  # a broken connection: stop anyway
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(3)
        if not self._loop.is_running():
            self._loop.close()

    async def _shutdown(self) -> None:
        """Stop the publishers (what they still hold is in the workers' replay buffers) and disconnect."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._nc is not None:
            await self._nc.close()

    @property
    def pending(self) -> int:
        return sum(q.qsize() for q in self._queues.values())

    # ---- NATS side (on the loop) -------------------------------------------------------------
    async def _setup(self) -> None:
        cfg = self.cfg
        self._nc = await nats.connect(cfg.nats_url, name="prefixscope-relay", allow_reconnect=True,
                                      max_reconnect_attempts=-1, reconnect_time_wait=0.5, connect_timeout=2,
                                      error_cb=self._nats_error)
        js = self._js = self._nc.jetstream()
        sc = StreamConfig(name=cfg.stream, subjects=[f"{cfg.subject_prefix}.>"], retention=RetentionPolicy.LIMITS,
                          max_age=cfg.max_age_s, max_bytes=cfg.max_bytes, storage=StorageType.FILE,
                          discard=DiscardPolicy.OLD, duplicate_window=min(DUPLICATE_WINDOW_S, cfg.max_age_s))
        try:
            await js.stream_info(cfg.stream)
            await js.update_stream(sc)
        except NotFoundError:
            await js.add_stream(sc)
        for w in cfg.workers:
            try:
                last = await js.get_last_msg(cfg.stream, subject_for(cfg.subject_prefix, w.name))
            except NotFoundError:
                continue
            try:
                self.resume[w.name] = int((last.headers or {})[H_SEQ])
            except (KeyError, ValueError):
                log.warning("worker %s: last stream message has no %s: replaying from 0", w.name, H_SEQ)
        log.info("relaying %d worker(s) to %s stream %s (max_age %gs, max_bytes %d); resuming %d",
                 len(cfg.workers), cfg.nats_url, cfg.stream, cfg.max_age_s, cfg.max_bytes, len(self.resume))

    async def _nats_error(self, exc: Exception) -> None:
        log.debug("NATS: %s", exc)

    def forward(self, worker: str, seq: int, payload: bytes) -> None:
        """On the ZMQ thread: queue one batch for its worker's publisher (blocks while max_pending wait)."""
        restart = worker in self._restarts.pending
        self._restarts.pending.discard(worker)
        while not self._slots.acquire(timeout=0.2):
            if self._stop.is_set():
                return
        self._loop.call_soon_threadsafe(self._enqueue, worker, (seq, payload, restart))

    def _enqueue(self, worker: str, item: tuple[int, bytes, bool]) -> None:
        q = self._queues.get(worker)
        if q is None:
            q = self._queues[worker] = asyncio.Queue()
            self._loop.create_task(self._pump(worker, q))
        q.put_nowait(item)

    async def _pump(self, worker: str, q: asyncio.Queue[tuple[int, bytes, bool]]) -> None:
        """One worker's batches, in order, each until acknowledged."""
        subject = subject_for(self.cfg.subject_prefix, worker)
        topic = self._topics.get(worker, b"")
        js = self._js
        assert js is not None, "started by _setup"
        while True:
            seq, payload, restart = await q.get()
            headers = headers_for(worker, seq, payload, topic, restart)
            delay = 0.1
            while True:
                try:
                    await js.publish(subject, payload, timeout=2.0, headers=headers)
                    break
                except Exception as exc:
                    self.retries += 1
                    if self.retries % 50 == 1:
                        log.warning("worker %s seq %d: publish failed (%s); retrying", worker, seq,
                                    exc or type(exc).__name__)
                    await asyncio.sleep(delay)
                    delay = min(2.0, delay * 2)
            self.published += 1
            self._slots.release()


# ---- the command ---------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefixscope relay",
                                description="Relay workers' vLLM KV-event streams (ZMQ) into a NATS JetStream "
                                            "stream, one subject per worker (see docs/operating.md).")
    p.add_argument("--config.file", dest="config_file", metavar="FILE", required=True, help="relay YAML")
    p.add_argument("--log.level", dest="log_level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_relay_config(args.config_file)
    except ConfigError as exc:
        print(f"prefixscope relay: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    relay = Relay(cfg)
    try:
        try:
            relay.start()
        except Exception as exc:
            print(f"prefixscope relay: cannot start: {exc or type(exc).__name__}", file=sys.stderr)
            return 1
        log.info("relay running")
        last = time.monotonic()
        while not stop.wait(0.5):
            if time.monotonic() - last >= 60:
                last = time.monotonic()
                log.info("published %d batch(es), %d retries, %d pending", relay.published, relay.retries,
                         relay.pending)
    finally:
        relay.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0
