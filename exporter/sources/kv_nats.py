"""KV-cache events from NATS: the relay's JetStream stream, and Dynamo's own KV-event messages.

**The relay's stream** (layout in :mod:`exporter.codecs.kv_stream`): one durable pull consumer per
exporter (``durable``) over ``<prefix>.>``, in the stream's one total order of every worker's
batches (so every shard and a single exporter see the same interleaving). The rules, in order:

* **start-up rebuild**: the exporter's state lives in memory, so at start the durable consumer is
  created afresh from the first retained message (``deliver_policy=all``): every retained batch
  of every worker is applied again. That is also how a killed process (or shard) recovers: what
  it had fetched and not acknowledged, and everything since, is in the stream, and after the
  rebuild its index and counters equal those of a process that never died (tests/e2e/test_shards.py).
  The durable name must be this process's own: one that another live exporter is pulling from is
  reported as an ingest error (``durable``), as the two would split the stream between them. ``wait_started`` turns true once the consumer has reached
  the stream's last sequence as it was at start. A worker whose first retained batch has seq > 0
  joined before the retention window: like a late join on ZMQ, it is logged, not a gap (size
  ``max_age`` to cover how long a block stays cached; docs/operating.md);
* **exactly once**: a message whose stream sequence is not above the last one applied is a
  redelivery (lost ack, consumer recreated after a NATS restart) and is skipped, counted in
  ``duplicates``; acknowledgements are ``AckAll`` on the last message of each fetch;
* **the worker's own sequence** (header ``Prefixscope-Seq``): the next expected one is the last
  + 1; a jump forward is loss the relay could not heal from the worker's replay — counted as a
  gap and missed batches, nothing more to fetch;
* **a message is judged, not trusted** (``ingest_errors{source="kv_events"}``, each rejected
  message counted by kind, none applied): one whose ``Prefixscope-Worker`` names another worker
  than its subject (``identity``); one whose seq is not an integer in 0..2^53, or jumps more than
  ``MAX_JUMP`` ahead unless the next message confirms the new sequence (``sequence``); one at or
  below a seq already applied that no restart explains — a duplicate the stream's own
  deduplication let through, or a reordered one (``duplicate``, skipped). A worker restart is
  recognised only by what a restart gives: the relay's ``Prefixscope-Restart`` header (the
  relay watched the worker's own stream go back), or the sequence back at 0 with another batch
  than the worker's first one (its ``Nats-Msg-Id`` carries the payload's digest); then the
  worker's view is cleared through ``sink.worker_restarted``;
* NATS down or restarted: the client reconnects forever; the durable consumer is kept by the
  server (file storage), and if it is gone it is recreated from the last applied stream
  sequence + 1, so nothing retained is skipped and nothing is applied twice.

**Dynamo** (format in :mod:`exporter.codecs.dynamo_events`): core NATS subscriptions on the
configured subjects (wildcards allowed): ``namespace.<ns>.component.<component>.endpoint.<endpoint>.kv-events``
(Dynamo 1.6+), ``namespace.<ns>.component.<component>.kv-events`` (1.0 with the local indexer),
``namespace-<ns>-component-<component>-kv-events.kv-events`` (1.0's JetStream path, read as
published). Every worker on those subjects is taken: Dynamo's worker ids are the cluster's own
(its discovery's instance ids), so the subjects select the deployment, not a worker list. Core
NATS keeps nothing, and there is no replay to ask for.

How Dynamo numbers what it publishes (ai-dynamo/dynamo: the event plane's ``EventPublisher`` in
lib/runtime/src/transports/event_plane/mod.rs; ``KvEventPublisher`` in
lib/llm/src/kv_router/publisher/mod.rs; the instance ids of lib/runtime/src/discovery/kube/utils.rs;
what the 1.6.1 and 1.0.2 wheels publish is in tests/fixtures/dynamo_runtime_capture.json):

* the envelope's ``sequence`` counts one ``EventPublisher``'s messages from 0, in memory (one
  publisher per ``KvEventPublisher``, i.e. per worker process and data-parallel rank). In 1.6+
  its ``publisher_id`` is drawn at random when it is created (53 bits), so a restarted worker
  publishes under a new id from 0: a lower sequence from a publisher already seen is never a
  restart there, only a duplicate, a reordered or a forged message. In 1.0 the id was the
  process's discovery instance id, which is the worker id (its ranks share it, each with its own
  sequence: :meth:`DynamoMessage.sequence_key`); under Kubernetes discovery that id is a hash of
  the pod's name, so a worker restarted in its pod comes back under the same id at sequence 0;
* ``event_id`` is the ``KvEventPublisher``'s own in-memory counter, so every new process numbers
  again from the start (0 in 1.0, 1 in 1.6.1) under the same worker id where that id outlives
  the process (a pod's name; 1.6's explicit ``worker_id``). For a 1.6 restart this is the only
  sign (a new publisher whose events go back in ``event_id``); for bare 1.0 JSON it is the only
  number there is. (Where the worker id is new with every process — etcd leases, file discovery —
  a restarted worker is a new worker, not a restart.)

The rules, in order, per unit — an enveloped message whole, under its envelope's key and
``sequence``; a bare message's batch, under its worker and ``event_id``:

* **judged first**: a number beyond 0..2^53, or more than ``MAX_JUMP`` ahead unless the next
  message confirms it, is rejected and counted (``sequence``), its message (or batch) not applied;
* **loss**: a jump in a publisher's ``sequence`` (in ``event_id`` per worker and rank for a bare
  message) is counted as a gap and missed batches of its worker;
* **a number that went back is held, not believed** — the key's ``sequence``, or any of its
  workers' ``event_id``, lower than the one expected: one stray, duplicated, reordered or forged
  message must not clear a healthy worker's view. Nothing of it is applied or counted yet; each
  key holds at most one (bounded like the other per-key state, and by ``MAX_HELD_BYTES`` in all:
  the oldest is forgotten first, counted as not confirmed), and no other key waits for it. What follows settles it: the key's
  next unit **continuing the held one** (its number at least the held one's plus its count, and,
  when the key's own series went back, still below where that series stood) confirms a restart:
  each worker's view is cleared (``sink.worker_restarted``, once), the held unit applied, then the
  new one. The **old series going on** instead — the key's next number where it was expected or
  beyond, or another publisher carrying the worker's old ``event_id`` numbering on — refutes it,
  as does a next number that continues neither: it is counted (``sequence``, below the series
  and not confirmed) and dropped, and the new unit is taken as usual. One rule serves every
  version: 1.0's restart comes back under the same key, 1.6's under a new one with its event ids
  gone back, and a 1.6 publisher's own next message refutes a lower sequence of its id;
* **a held restart nothing follows** for ``RESTART_CONFIRM_S`` is confirmed: a restarted worker
  publishes the stores of its first request and may then idle. The source's own loop checks
  between messages (and each message before it is handled), on the source's clock — the one
  risk left: a lone forged message from a worker that then goes quiet.

The relay's stream keeps its own rule (above): the relay saw a restart on the worker's own socket.

Batches are decoded by :mod:`exporter.codecs.kvcodec` (the relay sends vLLM's payload unchanged) and
handed to the sink like the ZMQ subscriber does (``sink.apply_kv_batch``), so the state counts
batches, applied events, lag and restarts the same way; this adapter counts gaps, missed
batches and decode errors. All sink calls come from this source's one thread.

**Lag once caught up**, as on ZMQ: a worker's lag is its last applied batch's age when applied, so
a worker that goes quiet after a backlog would read that backlog's lag for as long as it stays
quiet. A lag of ``LAG_FLOOR_S`` or more is set back to 0 once nothing waits: on the stream, when a
pull comes back short of a full fetch (or empty); on Dynamo's subjects, when no delivered message
waits in any subscription's queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial

import nats
from nats.aio.subscription import Subscription
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from exporter.codecs import dynamo_events, kvcodec
from exporter.codecs.kv_stream import (
    DEFAULT_PREFIX,
    DEFAULT_STREAM,
    H_MSG_ID,
    H_RESTART,
    H_SEQ,
    H_WORKER,
    worker_from_subject,
)
from exporter.core.health import Health
from exporter.loops.duty_clock import DutyClock
from exporter.model import KvBatch, KvSink
from exporter.sources.kv_zmq import LAG, LAG_FLOOR_S

log = logging.getLogger("prefixscope.kv_nats")

SOURCE = "kv_events"
FETCH = 512  # messages per pull
RETRY_S = 0.5
MAX_PUBLISHERS = 65_536  # Dynamo publishers (and worker ranks) whose sequence is remembered, oldest forgotten first
MAX_SEQ = 2**53  # vLLM counts batches from 0; beyond this a seq is no count of batches
MAX_JUMP = 1_000_000  # batches a worker may skip at once (a day at ten a second) unless confirmed
RESTART_CONFIRM_S = 5.0  # a Dynamo message whose number went back, with nothing after it this long, is a restart
MAX_HELD_BYTES = 64 * 2**20  # what Dynamo messages held for confirmation may keep in all (their wire size)


@dataclass(frozen=True)
class NatsKvSettings:
    url: str
    stream: str = DEFAULT_STREAM
    subject_prefix: str = DEFAULT_PREFIX
    workers: frozenset[str] | None = None  # None: every worker on the stream
    durable: str = "prefixscope-export"
    relay: bool = True  # read the relay's stream
    dynamo_subjects: tuple[str, ...] = ()
    dynamo_block_size: int = 16
    attribution: bool = False  # keep the stored blocks' lora_name and extra_keys (exporter.core.attribution)


class NatsKvSource:
    """``start()`` runs the source on its own thread (an asyncio loop); ``close()`` stops it."""

    def __init__(self, settings: NatsKvSettings, sink: KvSink, health: Health,
                 clock: Callable[[], float] = time.time, home: Callable[[str], bool] | None = None,
                 duties: DutyClock | None = None) -> None:
        """``home``: whether this process counts a worker's sequence gaps and missed batches (a
        family shard: only the worker's home shard, so each gap is counted once); None: every worker."""
        self.settings = settings
        self.home = home
        self.sink = sink
        self.health = health
        self.clock = clock
        self.duties = duties or DutyClock()  # each fetched batch of messages is one batch of kv_ingest
        self.applied = 0
        self.duplicates = 0
        self.last_stream_seq = 0
        self._next: dict[str, int] = {}
        # Dynamo publisher (DynamoMessage.sequence_key) -> (next sequence, worker)
        self._dyn_publishers: dict[tuple[int, str | None], tuple[int, str | None]] = {}
        self._dyn_events: dict[str, int] = {}  # Dynamo worker (and rank) -> next event_id
        self._dyn_jump: dict[object, int] = {}  # Dynamo publisher or worker -> a number too far ahead, awaiting confirmation
        self._dyn_seen: set[str] = set()  # Dynamo workers whose gap series exists (as many as its series)
        self._dyn_held: dict[object, _Held] = {}  # Dynamo publisher or worker -> its unit held as a possible restart
        self._dyn_held_workers: dict[str, object] = {}  # worker whose event_id went back -> the key holding it
        self._held_bytes = 0
        self._first_id: dict[str, str] = {}  # worker -> Nats-Msg-Id of the batch it started at (seq 0)
        self._jump: dict[str, int] = {}  # worker -> a seq too far ahead, awaiting the next to confirm it
        self._behind: set[str] = set()  # workers whose last applied batch lagged LAG_FLOOR_S or more
        self._apply_failures: set[type] = set()  # kinds of apply failure already logged with a traceback
        self._dyn_subs: list[Subscription] = []  # Dynamo's subscriptions (their queues say whether messages wait)
        self._started = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("source already started")
        self._thread = threading.Thread(target=self._run, name="prefixscope-kv-nats", daemon=True)
        self._thread.start()

    def wait_started(self, timeout: float = 30.0) -> bool:
        """True once the start-up rebuild reached the stream's end as it was at start."""
        return self._started.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("NATS KV-event thread did not stop within %.1fs", timeout)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main())
        except Exception:
            log.exception("NATS KV-event source stopped on an unexpected error")
            self.health.error(SOURCE, "subscriber", "NATS source stopped; see the log")
        finally:
            self._started.set()
            loop.close()

    async def _main(self) -> None:
        nc = None
        while nc is None and not self._stop.is_set():
            try:
                nc = await nats.connect(self.settings.url, name="prefixscope-export", allow_reconnect=True,
                                        max_reconnect_attempts=-1, reconnect_time_wait=RETRY_S,
                                        connect_timeout=1, error_cb=self._nats_error)
            except Exception as exc:
                log.warning("NATS %s: cannot connect (%s); retrying", self.settings.url, exc)
                await asyncio.sleep(RETRY_S)
        if nc is None:
            return
        try:
            for subject in self.settings.dynamo_subjects:
                self._dyn_subs.append(await nc.subscribe(subject, cb=self._on_dynamo))
                log.info("Dynamo KV events: subscribed to %s", subject)
            if self.settings.dynamo_subjects:
                await nc.flush()  # the server has the subscriptions: core NATS keeps nothing sent before
            if self.settings.relay:
                await self._consume(nc)
            else:
                self._started.set()
                while not self._stop.is_set():
                    await asyncio.sleep(0.1)
                    self._dyn_tick()
        finally:
            with contextlib.suppress(Exception):  # closing a broken connection
                await nc.close()

    async def _nats_error(self, exc: Exception) -> None:
        log.debug("NATS: %s", exc)

    # ---- the relay's stream -----------------------------------------------------------------
    async def _consume(self, nc: nats.NATS) -> None:
        s = self.settings
        js = nc.jetstream()
        target = await self._stream_end(js)
        if target is None:
            return
        await self._warn_if_shared(js)
        with contextlib.suppress(NotFoundError):
            await js.delete_consumer(s.stream, s.durable)
        psub = await self._subscribe(js, DeliverPolicy.ALL, None)
        log.info("KV events from NATS stream %s (%s.>): rebuilding from %d retained message(s)",
                 s.stream, s.subject_prefix, target)
        if target == 0:
            self._started.set()
        failures = 0
        while not self._stop.is_set():
            self._dyn_tick()  # Dynamo's subscriptions share this loop: their held restarts come due here
            try:
                msgs = await psub.fetch(FETCH, timeout=0.5)
            except (TimeoutError, nats.errors.TimeoutError):
                if self.last_stream_seq >= target:
                    self._started.set()
                self._caught_up()
                continue
            except Exception as exc:
                failures += 1
                log.warning("NATS stream %s: fetch failed (%s)", s.stream, exc or type(exc).__name__)
                await asyncio.sleep(RETRY_S)
                if failures % 4 == 0 and nc.is_connected:
                    psub = await self._resubscribe(js, psub)
                continue
            failures = 0
            with self.duties.duty("kv_ingest"):
                for m in msgs:
                    self._handle(m.subject, m.headers or {}, m.data, m.metadata.sequence.stream)
            try:
                await msgs[-1].ack()  # AckAll: everything up to here
            except Exception as exc:
                log.debug("ack failed: %s", exc)
            if self.last_stream_seq >= target:
                self._started.set()
            if len(msgs) < FETCH:  # the pull took what was there: nothing more waits
                self._caught_up()

    async def _warn_if_shared(self, js: nats.js.JetStreamContext) -> None:
        """A durable someone is pulling from right now belongs to another live exporter (an HA twin or
        a second copy of this shard with the same ``durable``): deleting it and pulling from it too
        would split the stream between the two, each missing the other's half. Say so, loudly;
        a durable left by a killed process has no waiting pulls and is simply recreated."""
        try:
            info = await js.consumer_info(self.settings.stream, self.settings.durable)
        except Exception:
            return
        if info.num_waiting:
            self.health.error(SOURCE, "durable", f"durable consumer {self.settings.durable} has {info.num_waiting} "
                              "pull(s) waiting from another process: give every exporter its own kv_nats.durable")

    async def _stream_end(self, js: nats.js.JetStreamContext) -> int | None:
        """The stream's last sequence now (waiting for the relay to create it)."""
        warned = False
        while not self._stop.is_set():
            try:
                info = await js.stream_info(self.settings.stream)
                return info.state.last_seq
            except NotFoundError:
                if not warned:
                    log.warning("NATS stream %s does not exist yet (is the relay running?)", self.settings.stream)
                    warned = True
            except Exception as exc:
                log.debug("stream info: %s", exc)
            await asyncio.sleep(RETRY_S)
            self._dyn_tick()
        return None

    async def _subscribe(self, js: nats.js.JetStreamContext, policy: DeliverPolicy, start: int | None):
        s = self.settings
        cfg = ConsumerConfig(durable_name=s.durable, deliver_policy=policy, opt_start_seq=start,
                             ack_policy=AckPolicy.ALL, ack_wait=30, max_ack_pending=-1,
                             filter_subject=f"{s.subject_prefix}.>")
        return await js.pull_subscribe(f"{s.subject_prefix}.>", durable=s.durable, stream=s.stream, config=cfg)

    async def _resubscribe(self, js: nats.js.JetStreamContext, old):
        """The consumer may be gone (a NATS restart without it): recreate it past what was applied."""
        try:
            await js.consumer_info(self.settings.stream, self.settings.durable)
            return old
        except NotFoundError:
            pass
        except Exception:
            return old
        log.warning("NATS consumer %s is gone: recreating it from stream seq %d", self.settings.durable,
                    self.last_stream_seq + 1)
        with contextlib.suppress(Exception):
            await old.unsubscribe()
        return await self._subscribe(js, DeliverPolicy.BY_START_SEQUENCE, self.last_stream_seq + 1)

    def _handle(self, subject: str, headers: dict[str, str], data: bytes, stream_seq: int) -> None:
        """One relayed batch, by the rules of the module docstring."""
        if stream_seq <= self.last_stream_seq:
            self.duplicates += 1
            return
        self.last_stream_seq = stream_seq
        named = worker_from_subject(self.settings.subject_prefix, subject)
        worker = headers.get(H_WORKER) or named
        if worker is None or (self.settings.workers is not None and worker not in self.settings.workers):
            return
        if named is not None and worker != named:
            self.health.error(SOURCE, "identity", f"stream message {stream_seq} on {subject} names worker {worker!r}")
            return
        try:
            seq = int(headers[H_SEQ])
        except (KeyError, ValueError):
            self.health.error(SOURCE, "frame", f"worker {worker}: stream message {stream_seq} without a valid {H_SEQ}")
            return
        if not self._relay_sequence(worker, seq, headers, stream_seq):
            return
        batch = kvcodec.decode_batch(data, worker, seq, self.health, attribution=self.settings.attribution)
        if batch is not None:
            self._apply_batch(batch)

    def _relay_sequence(self, worker: str, seq: int, headers: dict[str, str], stream_seq: int) -> bool:
        """Whether a relayed batch at ``seq`` is applied (the rules of the module docstring); a
        restart it proves is passed on, loss it shows is counted, a misfit is counted and refused."""
        if not 0 <= seq <= MAX_SEQ:
            self.health.error(SOURCE, "sequence", f"worker {worker}: stream message {stream_seq} has seq {seq}")
            return False
        expected = self._next.get(worker)
        msg_id = headers.get(H_MSG_ID, "")
        jump, self._jump[worker] = self._jump.pop(worker, None), seq
        if expected is None:
            if seq > 0:
                log.info("worker %s: first retained batch is seq %d (joined within its run)", worker, seq)
        elif headers.get(H_RESTART) == "1":  # the relay saw the worker restart (kv_zmq's restart rule)
            log.info("worker %s: the relay saw it restart (seq %d to %d)", worker, expected - 1, seq)
            self._apply(lambda: self.sink.worker_restarted(worker), worker)
        elif seq < expected:
            if not (seq == 0 and msg_id.startswith(f"{worker}:0:") and msg_id != self._first_id.get(worker)):
                self.health.error(SOURCE, "duplicate", f"worker {worker}: stream message {stream_seq} has seq {seq}, "
                                  f"already past (next expected {expected}), and no restart")
                self.duplicates += 1
                return False
            log.info("worker %s: KV-event sequence went from %d to %d: worker restarted", worker, expected - 1, seq)
            self._apply(lambda: self.sink.worker_restarted(worker), worker)
        elif seq > expected:
            if seq - expected > MAX_JUMP and jump != seq - 1:
                self.health.error(SOURCE, "sequence", f"worker {worker}: stream message {stream_seq} jumps from seq "
                                  f"{expected - 1} to {seq}; taken only if the next message confirms it")
                return False
            if self.home is None or self.home(worker):
                self.health.inc("prefixscope_kv_event_sequence_gaps", (worker,))
                self.health.inc("prefixscope_kv_event_missed_batches", (worker,), seq - expected)
        self._jump.pop(worker, None)
        if seq == 0:
            self._first_id[worker] = msg_id
        self._next[worker] = seq + 1
        return True

    def _apply_batch(self, batch: KvBatch, received_at: float | None = None) -> None:
        """``received_at``: when it arrived, if not now (a Dynamo message held for confirmation)."""
        received_at = self.clock() if received_at is None else received_at
        if received_at - batch.ts >= LAG_FLOOR_S:
            self._behind.add(batch.worker)
        self._apply(lambda: self.sink.apply_kv_batch(batch, received_at), batch.worker)

    def _caught_up(self) -> None:
        """Nothing waits: the lagging workers' lag reads 0 (only series that exist are set: a family
        shard that is not a worker's home keeps none)."""
        for worker in self._behind:
            self.health.set_existing(LAG, (worker,), 0.0)
        self._behind.clear()

    def _apply(self, call: Callable[[], None], worker: str) -> None:
        try:
            call()
            self.applied += 1
        except Exception as exc:  # a state bug on one batch must not stop the stream
            if type(exc) not in self._apply_failures:  # one traceback per kind of failure, not one per batch
                self._apply_failures.add(type(exc))
                log.exception("worker %s: applying KV events failed", worker)
            self.health.error(SOURCE, "apply", f"worker {worker}: {type(exc).__name__}: {exc}")

    # ---- Dynamo ----------------------------------------------------------------------------
    async def _on_dynamo(self, msg: nats.aio.msg.Msg) -> None:
        with self.duties.duty("kv_ingest"):
            self.handle_dynamo(msg.subject, msg.data)
            if self._behind and not any(sub.pending_msgs for sub in self._dyn_subs):
                self._caught_up()

    def _dyn_tick(self) -> None:
        """The source's loop, between messages: held restarts nothing refuted in ``RESTART_CONFIRM_S``
        are confirmed now (a restarted worker may publish once and go quiet)."""
        if not self._dyn_held:
            return
        with self.duties.duty("kv_ingest"):
            self._confirm_due()

    def handle_dynamo(self, subject: str, data: bytes) -> None:
        """One Dynamo KV-event message: sequenced by the envelope's ``sequence`` per publisher (by
        ``event_id`` per worker and rank when bare), then each worker's events applied — or held,
        when its number went back, until a restart is confirmed (the module docstring's rules).

        Every worker publishing on the subscribed subjects is taken, named or not: Dynamo's worker
        ids are its discovery's instance ids, so the subjects are what selects the deployment."""
        msg = dynamo_events.decode_message(data, self.settings.dynamo_block_size, where=subject, health=self.health)
        if msg is None:
            return
        self._confirm_due()
        now = self.clock()
        key = msg.sequence_key()
        enveloped = key is not None and msg.sequence is not None
        if enveloped:
            known = self._dyn_publishers.get(key)
            if not self._dyn_fits(key, msg.sequence, known[0] if known else None,
                                  f"{subject}: publisher {key[0]}'s sequence"):
                return  # judged, not trusted: nothing of it applied, nothing taken for a restart
        batches = [b for b in msg.batches(now)
                   if self._dyn_fits(b.worker, b.seq, self._dyn_events.get(b.worker),
                                     f"{subject}: worker {b.worker}'s event_id")]
        if enveloped:
            units = [_Unit(key, msg.sequence, 1, msg.events[0].worker if msg.events else None, batches, True,
                           f"{subject}: publisher {key[0]}")]
        else:
            units = [_Unit(b.worker, b.seq, len(b.events), b.worker, [b], False, f"{subject}: worker {b.worker}")
                     for b in batches]
        for unit in units:
            self._dyn_unit(unit, len(data) // len(units))

    def _dyn_unit(self, unit: _Unit, size: int) -> None:
        """One sequenced unit: it settles what its key held, refutes a hold its worker's old
        numbering continues, then is held itself (its number went back) or applied."""
        held = self._dyn_held.get(unit.key)
        if held is not None:
            if held.old is not None and unit.number >= held.old:
                self._refute(held, f"the series went on at {unit.number}")
            elif unit.number >= held.unit.number + held.unit.count:
                self._confirm(held, f"continued at {unit.number}")
            else:
                self._refute(held, f"followed by {unit.number}, no continuation of it")
        for batch in unit.batches:
            other = self._dyn_held_workers.get(batch.worker)
            if other is not None and other != unit.key:
                held = self._dyn_held[other]
                if batch.seq >= held.events.get(batch.worker, MAX_SEQ + 1):
                    self._refute(held, f"worker {batch.worker}'s event_id went on at {batch.seq}")
        went_back = {b.worker: self._dyn_events[b.worker] for b in unit.batches
                     if b.worker in self._dyn_events and b.seq < self._dyn_events[b.worker]}
        old: int | None = None
        workers = set(went_back)
        if unit.enveloped:
            known = self._dyn_publishers.get(unit.key)
            if known is not None and unit.number < known[0]:
                old = known[0]
                worker = unit.worker or known[1]
                if worker is not None:
                    workers.add(worker)
                unit.worker = worker
        elif went_back:
            old = went_back[unit.key]
        if workers:
            self._hold(unit, old, went_back, tuple(sorted(workers)), size)
        else:
            self._apply_unit(unit)

    def _hold(self, unit: _Unit, old: int | None, events: dict[str, int], workers: tuple[str, ...],
              size: int) -> None:
        """Keep a unit whose number went back, unapplied and uncounted, until it is confirmed or refuted."""
        self._dyn_held[unit.key] = _Held(unit, old, events, workers, self.clock(), size)
        self._held_bytes += size
        for worker in events:
            self._dyn_held_workers[worker] = unit.key
        log.debug("%s: number %d went back (workers %s): held until a restart is confirmed", unit.what,
                  unit.number, ", ".join(workers))
        while len(self._dyn_held) > MAX_PUBLISHERS or self._held_bytes > MAX_HELD_BYTES:
            self._refute(next(iter(self._dyn_held.values())), "forgotten: too many held at once")

    def _unhold(self, held: _Held) -> None:
        del self._dyn_held[held.unit.key]
        self._held_bytes -= held.size
        for worker in held.events:
            if self._dyn_held_workers.get(worker) == held.unit.key:
                del self._dyn_held_workers[worker]

    def _refute(self, held: _Held, why: str) -> None:
        """Not a restart: the held unit is dropped, counted once."""
        self._unhold(held)
        self.health.error(SOURCE, "sequence", f"{held.unit.what}: {held.unit.number} was below the series and "
                                              f"not confirmed as a restart ({why}); dropped")

    def _confirm(self, held: _Held, why: str) -> None:
        """A restart: each worker's view is cleared once, its numbering starts again with the held unit,
        and the held unit is applied (as received when it arrived: the hold is no lag)."""
        self._unhold(held)
        unit = held.unit
        for worker in held.workers:
            log.info("Dynamo worker %s: %s went back to %d and %s: worker restarted", worker, unit.what,
                     unit.number, why)
            self._apply(partial(self.sink.worker_restarted, worker), worker)
            self._dyn_events.pop(worker, None)
        if unit.enveloped:
            self._dyn_publishers.pop(unit.key, None)
        self._apply_unit(unit, held.at)

    def _confirm_due(self) -> None:
        """Held units nothing refuted within ``RESTART_CONFIRM_S`` are restarts (held in time order)."""
        if not self._dyn_held:
            return
        now = self.clock()
        while self._dyn_held:
            held = next(iter(self._dyn_held.values()))
            if now - held.at < RESTART_CONFIRM_S:
                return
            self._confirm(held, f"nothing refuted it in {RESTART_CONFIRM_S:g}s")

    def _apply_unit(self, unit: _Unit, received_at: float | None = None) -> None:
        if unit.enveloped:
            self._publisher_sequence(unit.key, unit.number, unit.worker)
        for batch in unit.batches:
            self._event_ids(batch.worker, batch.seq, len(batch.events), not unit.enveloped)
            self._apply_batch(batch, received_at)

    def _dyn_fits(self, key: object, value: int, expected: int | None, what: str) -> bool:
        """Whether a Dynamo sequence (a publisher's envelope ``sequence``, a worker's ``event_id``)
        may be taken, by the relay's rules: within 0..MAX_SEQ, and no more than ``MAX_JUMP`` ahead
        of the one expected unless the next message confirms it. A misfit is counted
        (``sequence``) and its message or batch is not applied: an absurd number would count
        billions of missed batches, and make the worker's next true message look like a restart."""
        jump = self._dyn_jump.pop(key, None)
        if not 0 <= value <= MAX_SEQ:
            self.health.error(SOURCE, "sequence", f"{what} is {value}, beyond 0..2^53")
            return False
        if expected is not None and value - expected > MAX_JUMP and jump != value - 1:
            self._dyn_jump[key] = value
            if len(self._dyn_jump) > MAX_PUBLISHERS:
                del self._dyn_jump[next(iter(self._dyn_jump))]
            self.health.error(SOURCE, "sequence", f"{what} jumps from {expected - 1} to {value}; "
                                                  f"taken only if the next message confirms it")
            return False
        return True

    def _publisher_sequence(self, publisher: tuple[int, str | None], seq: int, worker: str | None) -> None:
        """Loss on core NATS: a jump in a publisher's envelope sequence, counted against its worker
        (a sequence that went back never gets here: it was held, and is applied once confirmed)."""
        known = self._dyn_publishers.pop(publisher, None)
        if known is None:
            if seq > 0:
                log.info("Dynamo publisher %d (worker %s): first message is sequence %d (joined within its run)",
                         publisher[0], worker, seq)
        else:
            expected, last_worker = known
            worker = worker or last_worker
            if seq > expected and worker is not None and (self.home is None or self.home(worker)):
                self.health.inc("prefixscope_kv_event_sequence_gaps", (worker,))
                self.health.inc("prefixscope_kv_event_missed_batches", (worker,), seq - expected)
        self._dyn_publishers[publisher] = (seq + 1, worker)  # (re)inserted last: the oldest go first
        if len(self._dyn_publishers) > MAX_PUBLISHERS:
            del self._dyn_publishers[next(iter(self._dyn_publishers))]

    def _event_ids(self, worker: str, first: int, n: int, judge_gaps: bool) -> None:
        """A worker's (and rank's) ``event_id``: a jump is loss, judged here only for bare messages
        (an enveloped one is judged by its sequence); one that went back was held before."""
        expected = self._dyn_events.pop(worker, None)
        if expected is None and worker not in self._dyn_seen and (self.home is None or self.home(worker)):
            self._dyn_seen.add(worker)  # a stream with no gap reads 0, not missing (as on ZMQ)
            self.health.inc("prefixscope_kv_event_sequence_gaps", (worker,), 0)
        elif expected is not None and first > expected and judge_gaps and (self.home is None or self.home(worker)):
            self.health.inc("prefixscope_kv_event_sequence_gaps", (worker,))
            self.health.inc("prefixscope_kv_event_missed_batches", (worker,), first - expected)
        self._dyn_events[worker] = first + n
        if len(self._dyn_events) > MAX_PUBLISHERS:
            del self._dyn_events[next(iter(self._dyn_events))]


@dataclass(slots=True)
class _Unit:
    """What a Dynamo message is sequenced as: an enveloped message whole, under its envelope's key
    (:meth:`DynamoMessage.sequence_key`) and ``sequence``; a bare message's batch, under its worker
    and first ``event_id``."""

    key: tuple[int, str | None] | str
    number: int
    count: int  # how far the number moves: 1 message, or the batch's events
    worker: str | None  # the publisher's worker (enveloped), the batch's (bare)
    batches: list[KvBatch]
    enveloped: bool
    what: str  # names it in logs and errors


@dataclass(slots=True)
class _Held:
    """A unit whose number went back, waiting for what follows to confirm or refute a restart."""

    unit: _Unit
    old: int | None  # the number its key's series expected next (None: no series of that key went back)
    events: dict[str, int]  # worker -> the event_id its old numbering expected next, for each that went back
    workers: tuple[str, ...]  # whose views a confirmed restart clears
    at: float  # when it arrived (the source's clock)
    size: int  # its share of the message's bytes (what held units may keep)


def nats_workers(kv_events: Iterable[tuple[str, str | None]]) -> tuple[frozenset[str], frozenset[str]]:
    """The NATS URLs and the workers whose ``kv_events`` name one (``nats://host:port``)."""
    kv_events = list(kv_events)
    urls = {url for _, url in kv_events if url and url.startswith(("nats://", "tls://"))}
    names = frozenset(n for n, url in kv_events if url and url.startswith(("nats://", "tls://")))
    return frozenset(urls), names
