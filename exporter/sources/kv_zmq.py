"""Subscriber for vLLM KV-cache events from many workers: one thread applies, replays run beside it.

Each worker's ZMQ PUB endpoint gets its own SUB socket (so the socket, not the topic, names
the worker); one ``zmq.Poller`` serves them all. Messages are three frames
``[topic, seq (8 bytes, big-endian), msgpack payload]``. The topic frame must equal the
worker's configured topic exactly (ZMQ's subscription is only a prefix match, and ``""`` would
match every topic); a message with another topic is not this worker's: dropped and counted
(``topic``).

Sequence tracking, per worker, in this order:

* the next expected seq is the last one + 1 (0 before the first message);
* a seq at least ``MAX_SEQ_JUMP`` (2^40) past the expected one cannot be real — no worker
  publishes a trillion batches between two messages we see, while a corrupt or random 8-byte
  seq lands there with probability 1 - 2^-24 — so the message is dropped and counted
  (``sequence``) and the expected seq stays: one corrupt message costs only itself (this covers
  the replay's end marker 0xFF×8 arriving on the live stream, too);
* a smaller jump forward is a gap: it is counted, the missed batches are requested from the
  worker's ROUTER replay endpoint (if it has one) and applied in order *before* the batch that
  revealed the gap; only batches older than that one are taken from the replay, so the live
  stream never delivers one twice. A gap the replay healed is counted (``replays{result=
  "recovered"}``) and is nothing more. Batches no replay recovered are *lost*
  (``kv_event_lost_batches``): the view is rebuilt — the replay is asked again from seq 0,
  the view is cleared and refilled from what the worker's buffer still holds — and the sink is
  told (``sink.view_repaired``, counted as a repair) whether the rebuild was complete (the
  buffer went back to seq 0) or the view stays unreliable (until a complete rebuild, a cache
  reset or a restart: no count of later stores confirms blocks the lost batches cached). Without a
  replay endpoint nothing can be rebuilt: the view is kept and marked unreliable;
* a seq of 0 after others, or any seq below the expected one, means the worker restarted
  (vLLM's counter starts at 0 per process and PUB never reorders): its view is cleared through
  ``sink.worker_restarted``;
* the first batch seen from a worker (or after its restart) with seq > 0 is not a gap — we
  joined late — but the replay from 0 teaches us the blocks it already caches.

Replays after start run on a thread of their own per worker (a fresh DEALER each), at most
``MAX_REPLAYS`` fetching at once (the rest wait for a slot: what fetched replays hold until applied
stays bounded when every worker has a gap at once; a silent endpoint holds its slot at most
``REPLAY_TOTAL_TIMEOUTS`` × ``replay_timeout``), so a worker whose replay endpoint is slow or
silent delays nobody else: while its replay is out, that
worker's live messages wait in order in a per-worker queue and every other worker's messages
are applied as they come. The subscriber thread applies the replayed batches, then the waiting
ones, when the replay ends (its end marker, ``replay_timeout`` without a reply, or
``REPLAY_TOTAL_TIMEOUTS`` × ``replay_timeout`` in all). All state is applied on the subscriber
thread, in each worker's order.

At start, once the SUB sockets are connected, every worker with a replay endpoint is asked for
a replay from seq 0 (all at once, each bounded by ``replay_timeout`` per reply and
``REPLAY_TOTAL_TIMEOUTS`` × ``replay_timeout`` in all), so an idle worker's cache
is known without waiting for its next batch. The last replayed seq becomes a mark: live
messages that raced the replay (seq ≤ mark, same payload as the replayed batch) are skipped
as duplicates; a seq ≤ mark with another payload is a restart. The first live seq past the
mark ends the startup phase (batches between are fetched without counting a gap, as on a
late join); so does ``replay_timeout`` after the replay, by when every racing message is in.

The state may also ask for a rebuild (through the ``RebuildRequests`` the composition root hands
to both, from any thread) when a view drifts from what the worker reports; it runs on the
subscriber thread like a gap's.

Every configured stream's gap, missed, lost (and, with a replay endpoint, replay) series exist
from the start at 0: a stream without gaps reads 0, not missing.

The workers may change while it runs (:meth:`KvEventSubscriber.update_endpoints`, from any thread:
service discovery, a reload): on the subscriber thread a worker that left has its socket closed
and its sequence state dropped, and a new one is subscribed and, with a replay endpoint, asked for
its buffer from seq 0 at once (as at start: what it already caches is known without waiting for
its next batch; live messages that raced the replay are recognised as duplicates).

What waits to be applied is bounded, so a subscriber that falls behind (a burst larger than one
core follows, a stalled state) holds a bounded backlog, never gigabytes: each SUB socket's receive
queue holds at most ``queue_messages`` ÷ workers messages (``RCVHWM``, between ``MIN_QUEUE`` and
ZMQ's default 1,000), and a worker's live messages waiting behind its replay at most as many. The
connection's kernel buffer holds at most ``RECV_BUFFER_BYTES`` besides (Linux would otherwise grow it
to megabytes, where a backlog would wait unseen). Past
that, ZMQ stops reading the connection, the worker's PUB socket drops what it cannot send, and
the messages that wait behind a replay are dropped here: each is a gap in the sequence, counted
as missed batches when the next message arrives and healed by the replay like any other.

Each round reads every ready socket until it is empty (at most ``MAX_DRAIN`` messages, so one busy
worker cannot starve the others), with one receive time for the whole drain. Which sockets are
ready, and their messages, come from ``exporter.sources.zmq_rounds``: compiled, readiness from an
epoll set of the sockets' descriptors (a round costs what is ready), else pyzmq's poller (a poll
costs about half a microsecond per socket however few are ready). Either way rounds start at least
``ROUND_GAP_PER_SOCKET_S`` per socket apart (at most ``MAX_ROUND_GAP_S``, which is all this adds to
the lag): at a thousand workers, a busy stream's messages are read tens at a time per round rather
than a round for every few.

How far behind the subscriber is shows in the worker's ``kv_event_lag_seconds`` (set by the sink per
batch: receive time − the batch's stamp), so a backlog is seen before it sheds. A lag of
``LAG_FLOOR_S`` or more is set back to 0 once nothing of the worker waits (its receive queue read
empty, no replay out): the gauge says how far behind the exporter is, not how late the worker's last
batch was, so an idle worker after a burst, or one whose buffer a replay applied long after it was
published, does not read as lagging. Lags under the floor (network, NTP-kept clock offsets) stay as read.

BlockStored is idempotent in the state, so a replayed block that was also seen is harmless.
Per-batch stream health and restarts are counted by the sink (``ClusterState``); this adapter
counts gaps, missed batches, replays and frame/decode errors.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import zmq

from exporter.codecs import kvcodec
from exporter.core.health import Health
from exporter.loops.duty_clock import DutyClock
from exporter.model import KvBatch, KvSink, RebuildRequests
from exporter.sources.zmq_rounds import SocketRounds, make_rounds

log = logging.getLogger("prefixscope.kv_events")

SOURCE = "kv_events"
END_SEQ = b"\xff" * 8  # the replay's end marker: -1 as a signed 8-byte big-endian integer
MAX_DRAIN = 256  # messages taken from one socket per poll round, so one busy worker cannot starve others
# A poll costs about a microsecond per socket whether one or all of them are ready (the poll items are
# built anew each call), so at a thousand workers a poll per few messages spent more of the core than
# the messages did: rounds start at least this long apart per socket followed (capped at
# MAX_ROUND_GAP_S), so a poll's cost stays a small share of a round's and each drain finds more.
ROUND_GAP_PER_SOCKET_S = 1e-5
MAX_ROUND_GAP_S = 0.01  # at most this much is added to the lag by waiting for the next round
# Startup replays in flight at once: each holds a DEALER socket (a mailbox fd and a TCP connection
# on top of the worker's SUB socket), so a thousand workers replayed at once would need thousands
# of descriptors and more sockets than a ZMQ context allows by default (1,023).
MAX_STARTUP_REPLAYS = 64
# Replays fetched at once after start (gaps, rebuilds, joins): each holds the batches it fetched until
# the subscriber applies them (up to the worker's whole replay buffer), so when a subscriber that fell
# behind sheds into gaps on every worker at once, what the replays hold together stays bounded; the
# others wait for a slot (their live messages wait behind them, bounded as below).
MAX_REPLAYS = 64
# Sockets the context may hold beyond one SUB per worker: the startup replays and the rebuilds.
SPARE_SOCKETS = MAX_STARTUP_REPLAYS + MAX_REPLAYS
MIN_MAX_SOCKETS = 2048  # room for workers that join later (the limit is fixed once a socket exists)
# Payload digests kept per worker to recognise live duplicates of the startup replay: racing
# messages are the newest ones, queued in the SUB socket (receive HWM 1000 by default).
STARTUP_DEDUP = 2048
# Messages all the workers' receive queues may hold together (a vLLM batch is a few KB, so about
# 256 MB at most); each worker's queue between MIN_QUEUE and ZMQ's default HWM.
QUEUE_MESSAGES = 65_536
MIN_QUEUE = 16
MAX_QUEUE = 1000
# The kernel's receive buffer of each SUB connection. Left to itself Linux grows a fast connection's
# buffer up to net.ipv4.tcp_rmem's maximum (often 6–32 MB): a backlog would wait there, unseen by the
# receive queue's bound, for tens of seconds per worker before anything is shed.
RECV_BUFFER_BYTES = 256 * 1024
MAX_SEQ_JUMP = 1 << 40  # a forward jump this large is a corrupt seq, not a gap (see above)
REPLAY_TOTAL_TIMEOUTS = 10  # a replay ends after this many replay_timeouts in all, however it drips
_STOP_CHECK_S = 0.1  # how often a waiting replay thread looks at the stop flag
REPLAY_RESULTS = ("recovered", "partial", "failed")
LAG = "prefixscope_kv_event_lag_seconds"
LAG_FLOOR_S = 1.0  # a worker's lag from here up is cleared once nothing of it waits (see above)
LOST_BATCHES = "lost_batches"  # the repair reason for a rebuild after lost batches


@dataclass(frozen=True, slots=True)
class KvEndpoint:
    """Where one worker publishes: its PUB endpoint, its ROUTER replay endpoint (optional), its topic."""

    pub: str
    replay: str | None = None
    topic: str = ""


@dataclass(slots=True)
class _Replay:
    """One replay in flight for a worker and what waits for it (all touched on the subscriber thread)."""

    start: int
    end: int
    # "gap" (counted: recovered/partial/failed), "join" (a late join, not counted), "rebuild", "add" (a
    # worker that joined while the subscriber runs: its whole buffer)
    kind: str
    then: tuple[int, bytes, float] | None  # the live message that asked for it: (seq, payload, received_at)
    waiting: list[tuple[list[bytes], float]] = field(default_factory=list)  # later live messages
    reason: str = LOST_BATCHES  # why a rebuild runs (the repair's reason)


class KvEventSubscriber:
    """``start()`` runs the subscriber thread; ``close()`` stops it and closes every socket."""

    def __init__(self, endpoints: Mapping[str, KvEndpoint], sink: KvSink, health: Health, *,
                 replay_timeout: float = 2.0, poll_interval: float = 0.1,
                 clock: Callable[[], float] = time.time, token_ids: bool = False,
                 attribution: bool = False, duties: DutyClock | None = None,
                 rebuilds: RebuildRequests | None = None, queue_messages: int = QUEUE_MESSAGES) -> None:
        """``rebuilds``: where the state asks for views to be rebuilt (made by the composition root
        and handed to the state too); without one, only :meth:`request_rebuild` asks.
        ``queue_messages``: the messages all receive queues may hold together (see above)."""
        self.endpoints = dict(endpoints)
        self.queue_messages = queue_messages
        self.duties = duties or DutyClock()  # each poll round with work is one batch of kv_ingest
        self.sink = sink
        self.token_ids = token_ids  # decode the stored blocks' token ids (prefix text reads them)
        self.attribution = attribution  # keep the stored blocks' lora_name and extra_keys (exporter.core.attribution)
        self.health = health
        self.replay_timeout = replay_timeout
        self.poll_ms = max(1, int(poll_interval * 1000))
        self.round_gap_s = 0.0  # between two rounds' starts (set from the sockets followed, see MAX_ROUND_GAP_S)
        self.clock = clock
        self._next: dict[str, int] = {}
        # worker -> last seq its startup replay applied, until its first live message past it
        self.replayed_at_start: dict[str, int] = {}
        self._startup_mark: dict[str, int] = {}
        # worker -> digests (seq -> hash of the payload) of its startup replay, until _startup_until
        self._startup: dict[str, dict[int, int]] = {}
        self._startup_until = 0.0  # clock time after which no racing duplicate can still arrive
        self._topics = {w: ep.topic.encode() for w, ep in self.endpoints.items()}
        self._replays: dict[str, _Replay] = {}  # workers with a replay in flight
        self._behind: set[str] = set()  # workers whose last applied batch lagged LAG_FLOOR_S or more
        self._apply_failures: set[type] = set()  # kinds of apply failure already logged with a traceback
        # (worker, the batches fetched, whether the fetch held a slot of _replay_slots)
        self._replayed: queue.SimpleQueue[tuple[str, list[tuple[int, bytes]], bool]] = queue.SimpleQueue()
        self._replay_slots = threading.BoundedSemaphore(MAX_REPLAYS)
        self._replay_threads: dict[str, threading.Thread] = {}
        self.rebuilds = rebuilds if rebuilds is not None else RebuildRequests(
            w for w, ep in self.endpoints.items() if ep.replay is not None)
        self._ctx = zmq.Context()
        # one SUB per worker plus replays: past the default 1,023 sockets at about a thousand workers
        self._ctx.set(zmq.MAX_SOCKETS, max(self._ctx.get(zmq.MAX_SOCKETS), len(self.endpoints) + SPARE_SOCKETS,
                                           MIN_MAX_SOCKETS))
        self._changes: queue.SimpleQueue[dict[str, KvEndpoint]] = queue.SimpleQueue()  # desired endpoints
        self._rounds: SocketRounds = make_rounds()  # (exporter.sources.zmq_rounds)
        self._subs: dict[str, zmq.Socket] = {}  # worker -> its SUB socket (subscriber thread only)
        self._round_workers: list[str] | None = None  # the rounds' workers by index (None: to be told again)
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._started = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("subscriber already started")
        self._thread = threading.Thread(target=self._run, name="prefixscope-kv-events", daemon=True)
        self._thread.start()

    def request_rebuild(self, worker: str, reason: str) -> bool:
        """Ask for the worker's view to be rebuilt from its replay (any thread); False if it has
        no replay endpoint (nothing can rebuild it). The sink hears ``reset_view`` and then
        ``view_repaired`` from the subscriber thread."""
        return self.rebuilds(worker, reason)

    def update_endpoints(self, endpoints: Mapping[str, KvEndpoint]) -> None:
        """The workers to follow from now on (any thread; applied on the subscriber thread). Those
        with a replay endpoint can have their views rebuilt from then on."""
        self.rebuilds.replayable = frozenset(w for w, ep in endpoints.items() if ep.replay)
        self._changes.put(dict(endpoints))

    def _zero_series(self, workers: Mapping[str, KvEndpoint] | None = None) -> None:
        """Every configured stream's gap series exist from the start, at 0."""
        incs: list[tuple[str, tuple[str, ...], float]] = []
        for worker, ep in (self.endpoints if workers is None else workers).items():
            lab = (worker,)
            incs += [("prefixscope_kv_event_sequence_gaps", lab, 0), ("prefixscope_kv_event_missed_batches", lab, 0),
                     ("prefixscope_kv_event_lost_batches", lab, 0)]
            if ep.replay is not None:
                incs += [("prefixscope_kv_event_replays", (worker, r), 0) for r in REPLAY_RESULTS]
        self.health.update(incs)

    def wait_connected(self, timeout: float = 5.0) -> bool:
        """True once every SUB socket is created and connecting (subscriptions still propagate)."""
        return self._connected.wait(timeout)

    def wait_started(self, timeout: float = 10.0) -> bool:
        """True once the startup replays have been applied (or timed out) and live messages flow."""
        return self._started.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        self._stop.set()
        threads = [self._thread] if self._thread is not None else []
        for t in threads:  # the subscriber thread first: after it, no replay thread is started
            t.join(timeout)
            if t.is_alive():  # its sockets are still open: term() would block
                log.warning("KV-event thread %s did not stop within %.1fs", t.name, timeout)
                return
            threads.extend(th for th in self._replay_threads.values() if th not in threads)
        self._ctx.term()

    def __enter__(self) -> KvEventSubscriber:
        self.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # ---- the loop -------------------------------------------------------------------------
    def queue_limit(self) -> int:
        """Messages one worker's receive queue (and its messages waiting behind a replay) may hold."""
        return max(MIN_QUEUE, min(MAX_QUEUE, self.queue_messages // max(1, len(self.endpoints))))

    def _subscribe(self, worker: str, ep: KvEndpoint) -> None:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.queue_limit())  # before connecting: the pipe takes it then
        sock.setsockopt(zmq.RCVBUF, RECV_BUFFER_BYTES)  # (and the connection its buffer)
        sock.setsockopt(zmq.SUBSCRIBE, ep.topic.encode())
        sock.connect(ep.pub)
        self._subs[worker] = sock
        self._round_workers = None
        self._set_round_gap()

    def _set_round_gap(self) -> None:
        self.round_gap_s = min(MAX_ROUND_GAP_S, ROUND_GAP_PER_SOCKET_S * len(self._subs))

    def _unsubscribe(self, worker: str) -> None:
        sock = self._subs.pop(worker, None)
        if sock is not None:
            self._round_workers = None  # (before the next poll: the rounds drop the closed socket)
            sock.close(0)
            self._set_round_gap()

    def _apply_changes(self) -> None:
        """Follow the latest endpoints asked for: leave the workers that went, join the new ones."""
        desired: dict[str, KvEndpoint] | None = None
        while True:
            try:
                desired = self._changes.get_nowait()
            except queue.Empty:
                break
        if desired is None:
            return
        for worker in [w for w, ep in self.endpoints.items() if desired.get(w) != ep]:
            self._unsubscribe(worker)
            del self.endpoints[worker]
            self._behind.discard(worker)
            for per_worker in (self._next, self._topics, self.replayed_at_start, self._startup_mark, self._startup,
                               self._replays, self._replay_threads):
                per_worker.pop(worker, None)  # (a replay still out is dropped when it comes back)
            log.info("worker %s: KV events no longer followed", worker)
        added = {w: ep for w, ep in desired.items() if w not in self.endpoints}
        self._zero_series(added)
        for worker, ep in added.items():
            self.endpoints[worker] = ep
            self._topics[worker] = ep.topic.encode()
            self._subscribe(worker, ep)
            log.info("worker %s: following KV events at %s%s", worker, ep.pub,
                     f" (replay {ep.replay})" if ep.replay else "")
            self._start_replay(worker, 0, MAX_SEQ_JUMP, "add", None)  # what it caches already

    def _run(self) -> None:
        try:
            self._zero_series()
            for worker, ep in self.endpoints.items():
                self._subscribe(worker, ep)
            self._connected.set()
            with self.duties.duty("kv_ingest"):
                self._startup_replays()
                for worker in list(self._behind):  # a buffer replayed at start is old, not a backlog
                    self._caught_up(worker)
            self._started.set()
            round_at = 0.0
            while not self._stop.is_set():
                if not self._changes.empty():
                    self._apply_changes()
                if self._subs:
                    wait = round_at + self.round_gap_s - time.monotonic()
                    if wait > 0:  # the last round was short: let more arrive before paying for a poll
                        time.sleep(wait)
                    round_at = time.monotonic()
                    if self._round_workers is None:
                        self._round_workers = list(self._subs)
                        self._rounds.follow(self._subs[w] for w in self._round_workers)
                    ready = self._rounds.poll(self.poll_ms)
                else:  # no worker to follow (yet): wait for one without a poll over nothing
                    self._stop.wait(self.poll_ms / 1000)
                    ready = []
                if not ready and not self._replays and self.rebuilds.empty():
                    continue  # an idle round: nothing to drain, no replay or rebuild to finish
                with self.duties.duty("kv_ingest"):
                    for i in ready:
                        self._drain(i)
                    self.finish_replays()
        except Exception:  # the loop must not die silently: say why, then stop
            log.exception("KV-event subscriber stopped on an unexpected error")
            self.health.error(SOURCE, "subscriber", "subscriber thread stopped; see the log")
        finally:
            self._connected.set()
            self._started.set()
            for sock in self._subs.values():
                sock.close(0)

    def _drain(self, i: int) -> None:
        """Handle what socket ``i``'s receive queue holds, up to ``MAX_DRAIN`` messages; if that
        was all (it read empty), the worker is caught up. One receive time serves the whole drain:
        every one of these messages was in by then."""
        assert self._round_workers is not None
        worker = self._round_workers[i]
        messages, emptied = self._rounds.drain(i, MAX_DRAIN)
        handle, received_at = self.handle_message, self.clock()
        for frames in messages:
            handle(worker, frames, received_at)
        if emptied and worker in self._behind:
            self._caught_up(worker, drained=True)

    # ---- one message ----------------------------------------------------------------------
    def handle_message(self, worker: str, frames: list[bytes], received_at: float) -> None:
        """Check, sequence, decode and apply one live message (called on the subscriber thread)."""
        pending = self._replays.get(worker)
        if pending is not None:  # its replay is out: keep the worker's order
            if len(pending.waiting) < self.queue_limit():
                pending.waiting.append((frames, received_at))
            # else dropped: a gap after the waiting ones, counted and replayed when the next arrives
            return
        if len(frames) != 3 or len(frames[1]) != 8:
            self.health.error(SOURCE, "frame", f"worker {worker}: expected [topic, seq8, payload], got "
                              f"{len(frames)} frame(s) of sizes {[len(f) for f in frames][:5]}")
            return
        if frames[0] != self._topics[worker]:
            self.health.error(SOURCE, "topic", f"worker {worker}: topic {frames[0][:64]!r}, "
                              f"expected exactly {self._topics[worker]!r}: message dropped")
            return
        seq = int.from_bytes(frames[1], "big")
        expected = self._next.get(worker)
        if seq - (expected or 0) >= MAX_SEQ_JUMP:
            self.health.error(SOURCE, "sequence", f"worker {worker}: seq {seq} after "
                              f"{'none' if expected is None else expected - 1}: a jump of 2^40 or more "
                              "cannot be real; message dropped")
            return
        payload = frames[2]
        if self._startup_mark and self._after_startup_replay(worker, seq, payload, received_at):
            return
        replay: tuple[int, str] | None = None  # (start, kind)
        if expected is None:
            if seq > 0:  # joined a running worker: learn what it already caches
                replay = (0, "join")
        elif seq > expected:
            missing = seq - expected
            self.health.inc("prefixscope_kv_event_sequence_gaps", (worker,))
            self.health.inc("prefixscope_kv_event_missed_batches", (worker,), missing)
            replay = (expected, "gap")
        elif seq < expected:
            log.info("worker %s: KV-event sequence went from %d to %d: worker restarted", worker, expected - 1, seq)
            self._safely(worker, lambda: self.sink.worker_restarted(worker))
            if seq > 0:
                replay = (0, "join")
        self._next[worker] = seq + 1
        if replay is None or not self._start_replay(worker, replay[0], seq, replay[1], (seq, payload, received_at)):
            self._decode_and_apply(worker, seq, payload, received_at)
            if replay is not None and replay[1] == "gap":  # no replay endpoint: the loss stays
                self._lost(worker, seq - replay[0])
                self._safely(worker, lambda: self.sink.view_repaired(worker, LOST_BATCHES, False))

    def _lost(self, worker: str, n: int) -> None:
        self.health.inc("prefixscope_kv_event_lost_batches", (worker,), n)
        log.warning("worker %s: %d KV-event batch(es) lost for good", worker, n)

    def _decode_and_apply(self, worker: str, seq: int, payload: bytes, received_at: float) -> None:
        batch = kvcodec.decode_batch(payload, worker, seq, self.health, token_ids=self.token_ids,
                                     attribution=self.attribution)
        if batch is not None:
            self._apply(batch, received_at)

    def _after_startup_replay(self, worker: str, seq: int, payload: bytes, received_at: float) -> bool:
        """Handle a live message against the worker's startup replay; True if nothing more is to do."""
        if self._startup and received_at > self._startup_until:  # every racing message is in by now
            self._startup.clear()
        mark = self._startup_mark.get(worker)
        if mark is None:
            return False
        if seq <= mark and self._startup.get(worker, {}).get(seq) == hash(payload):
            return True  # applied already from the replay
        # seq <= mark with other content: a new process; the usual check sees the seq go back
        del self._startup_mark[worker]
        self._startup.pop(worker, None)
        if seq <= mark + 1:
            return False
        # published between the replay's answer and our subscription: not a gap
        self._next[worker] = seq + 1
        if not self._start_replay(worker, mark + 1, seq, "join", (seq, payload, received_at)):
            self._decode_and_apply(worker, seq, payload, received_at)
        return True

    def _caught_up(self, worker: str, drained: bool = False) -> None:
        """Clear the worker's lag if nothing of it waits: no replay out, its receive queue empty
        (``drained``: just read empty). Only a series that exists is set: a family shard that is not
        the worker's home keeps none."""
        if worker in self._replays:
            return
        if not drained:
            sock = self._subs.get(worker)
            if sock is not None and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                # more waits: the next live message sets the lag it really has. (Asking read the
                # socket's commands, and with them the signal the rounds wait for: drain it anyway.)
                self._drain_next_round(worker)
                return
        self._behind.discard(worker)
        self.health.set_existing(LAG, (worker,), 0.0)

    def _drain_next_round(self, worker: str) -> None:
        if self._round_workers is not None:  # (else every socket is drained in the next round)
            self._rounds.again(self._round_workers.index(worker))

    def _apply(self, batch: KvBatch, received_at: float) -> None:
        if received_at - batch.ts >= LAG_FLOOR_S:
            self._behind.add(batch.worker)
        # Per-batch stream health (batches, events applied, last timestamp, lag) and the restart
        # counter are the sink's to count (ClusterState does), so replays of a recorded stream that
        # bypass ZMQ count the same way; this adapter counts only what it alone sees: gaps and replays.
        try:  # (``_safely`` inline: this runs once per batch, no closure built for it)
            self.sink.apply_kv_batch(batch, received_at)
        except Exception as exc:
            self._failed(batch.worker, exc)

    def _safely(self, worker: str, call: Callable[[], None]) -> bool:
        try:
            call()
        except Exception as exc:
            self._failed(worker, exc)
            return False
        return True

    def _failed(self, worker: str, exc: Exception) -> None:
        """A state bug on one batch must not stop the stream: counted, one traceback per kind."""
        if type(exc) not in self._apply_failures:  # one traceback per kind of failure, not one per batch
            self._apply_failures.add(type(exc))
            log.exception("worker %s: applying KV events failed", worker, exc_info=exc)
        self.health.error(SOURCE, "apply", f"worker {worker}: {type(exc).__name__}: {exc}")

    # ---- replay ---------------------------------------------------------------------------
    def _start_replay(self, worker: str, start: int, end: int, kind: str, then: tuple[int, bytes, float] | None,
                      waiting: list[tuple[list[bytes], float]] | None = None, reason: str = LOST_BATCHES) -> bool:
        """Send the worker's replay request off on its own thread; False if it has no replay endpoint.

        ``then`` (the live message that revealed the need) and the worker's later live messages
        wait until :meth:`finish_replays` has applied the replayed batches.
        """
        endpoint = self.endpoints[worker].replay
        if endpoint is None or end <= start:
            return False
        self._replays[worker] = _Replay(start, end, kind, then, waiting or [], reason)
        thread = threading.Thread(target=self._fetch_replay, args=(worker, endpoint, start, end),
                                  name=f"prefixscope-kv-replay-{worker}", daemon=True)
        self._replay_threads[worker] = thread
        thread.start()
        return True

    def _fetch_replay(self, worker: str, endpoint: str, start: int, end: int) -> None:
        """On the worker's replay thread: collect batches ``start``..``end-1`` in order, hand them over.

        Replies come as ``[topic, seq8, payload]`` (vLLM ≥ 0.26) or ``[seq8, payload]`` (≤ 0.25)
        until the end marker; the wait for each reply is bounded by ``replay_timeout``, the whole
        replay by ``REPLAY_TOTAL_TIMEOUTS`` of them. Decoding and applying stay on the subscriber thread.
        """
        got: list[tuple[int, bytes]] = []
        while not self._replay_slots.acquire(timeout=_STOP_CHECK_S):  # released once it is applied
            if self._stop.is_set():
                self._replayed.put((worker, got, False))
                return
        try:
            sock = self._ctx.socket(zmq.DEALER)  # a fresh socket: no late reply of an earlier request
        except zmq.ZMQError as exc:  # the context is closing
            self.health.error(SOURCE, "replay", f"worker {worker}: replay from {endpoint} failed: {exc}")
            self._replayed.put((worker, got, True))
            return
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])  # REQ-style envelope for the ROUTER
            now = time.monotonic()
            hard_end = now + self.replay_timeout * REPLAY_TOTAL_TIMEOUTS
            reply_by = now + self.replay_timeout
            nxt = start
            while nxt < end and not self._stop.is_set():
                now = time.monotonic()
                wait = min(reply_by, hard_end) - now
                if wait <= 0:
                    break
                if not sock.poll(max(1, int(min(wait, _STOP_CHECK_S) * 1000)), zmq.POLLIN):
                    continue
                reply_by = time.monotonic() + self.replay_timeout
                reply = self._reply(worker, sock.recv_multipart())
                if reply is None:
                    continue
                seq, payload = reply
                if seq < 0:
                    break
                if seq < nxt or seq >= end:
                    continue
                nxt = seq + 1  # a jump here means the worker's buffer no longer holds the batches between
                got.append((seq, payload))
        except zmq.ZMQError as exc:
            self.health.error(SOURCE, "replay", f"worker {worker}: replay from {endpoint} failed: {exc}")
        finally:
            sock.close(0)
            self._replayed.put((worker, got, True))

    def _start_rebuilds(self) -> None:
        """Start the rebuilds the state asked for (a worker with a replay out waits for the next round)."""
        later: list[tuple[str, str]] = []
        while (asked := self.rebuilds.take()) is not None:
            worker, reason = asked
            if worker in self._replays:
                later.append((worker, reason))
                continue
            end = self._next.get(worker, 0)
            if not self._start_replay(worker, 0, end, "rebuild", None, reason=reason):  # nothing published yet
                self._safely(worker, lambda w=worker: self.sink.reset_view(w))
                self._safely(worker, lambda w=worker, r=reason: self.sink.view_repaired(w, r, True))
        for worker, reason in later:
            self.rebuilds(worker, reason)

    def finish_replays(self) -> None:
        """Apply every replay that has come back, then the live messages that waited for it."""
        self._start_rebuilds()
        while True:
            try:
                worker, got, held = self._replayed.get_nowait()
            except queue.Empty:
                return
            if held:  # the next waiting fetch may start: these batches are applied now or dropped
                self._replay_slots.release()
            pending = self._replays.pop(worker, None)
            if pending is None or worker not in self.endpoints:
                continue  # the worker left while its replay was out
            self._replay_threads.pop(worker, None)
            missing = pending.end - pending.start
            if pending.kind == "gap" and len(got) != missing:
                result = "partial" if got else "failed"
                self.health.inc("prefixscope_kv_event_replays", (worker, result))
                log.warning("worker %s: replay of seq %d..%d gave %d of %d batches", worker,
                            pending.start, pending.end - 1, len(got), missing)
                self._lost(worker, missing - len(got))
                # Rebuild: whatever the buffer still holds from seq 0, into a cleared view.
                if self._start_replay(worker, 0, pending.end, "rebuild", pending.then, pending.waiting):
                    continue
            if pending.kind == "rebuild":
                self._safely(worker, lambda w=worker: self.sink.reset_view(w))
            for seq, payload in got:
                self._decode_and_apply(worker, seq, payload, self.clock())
            if pending.kind == "gap" and len(got) == missing:
                self.health.inc("prefixscope_kv_event_replays", (worker, "recovered"))
            if pending.kind == "add" and got:  # a worker that joined: continue after its buffer
                mark = got[-1][0]
                self._next[worker] = mark + 1
                self.replayed_at_start[worker] = self._startup_mark[worker] = mark
                self._startup[worker] = {q: hash(p) for q, p in got[-STARTUP_DEDUP:]}
                self._startup_until = max(self._startup_until, self.clock() + self.replay_timeout)
                log.info("worker %s: rebuilt from its replay on joining (seq %d..%d)", worker, got[0][0], mark)
            if pending.kind == "rebuild":
                complete = [seq for seq, _ in got] == list(range(pending.end))
                if not complete:
                    log.warning("worker %s: rebuild from the replay got %d of %d batches: view unreliable until "
                                "a complete rebuild, a cache reset or a restart", worker, len(got), pending.end)
                self._safely(worker, lambda w=worker, r=pending.reason, c=complete: self.sink.view_repaired(w, r, c))
            if pending.then is not None:
                self._decode_and_apply(worker, *pending.then)
            for i, (frames, received_at) in enumerate(pending.waiting):
                self.handle_message(worker, frames, received_at)
                later = self._replays.get(worker)
                if later is not None:  # another replay went out: the rest waits behind it
                    later.waiting.extend(pending.waiting[i + 1:])
                    break
            if worker in self._behind:
                self._caught_up(worker)

    def _reply(self, worker: str, frames: list[bytes]) -> tuple[int, bytes] | None:
        """One replay reply as (seq, payload); seq -1 is the end marker; None (counted) if malformed.

        Replies come as ``[topic, seq8, payload]`` (vLLM ≥ 0.26) or ``[seq8, payload]`` (≤ 0.25).
        """
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:
            seq8, payload = frames[1], frames[2]
        elif len(frames) == 2:
            seq8, payload = frames
        else:
            self.health.error(SOURCE, "frame", f"worker {worker}: replay reply of {len(frames)} frame(s)")
            return None
        if seq8 == END_SEQ:
            return -1, b""
        if len(seq8) != 8:
            self.health.error(SOURCE, "frame", f"worker {worker}: replay seq of {len(seq8)} bytes")
            return None
        return int.from_bytes(seq8, "big"), payload

    def _startup_replays(self) -> None:
        """Replay every worker's buffer from seq 0 (a DEALER each, ``MAX_STARTUP_REPLAYS`` at a
        time), applying in seq order.

        Each worker's replay ends at its end marker or after ``replay_timeout`` without a reply
        (``REPLAY_TOTAL_TIMEOUTS`` × ``replay_timeout`` from its own start however slowly it
        drips); live messages meanwhile wait in the SUB sockets.
        """
        socks: dict[zmq.Socket, str] = {}
        deadline: dict[zmq.Socket, float] = {}
        hard_end: dict[zmq.Socket, float] = {}
        nxt: dict[str, int] = {}
        digests: dict[str, dict[int, int]] = {}
        poller = zmq.Poller()
        waiting = [(w, ep.replay) for w, ep in self.endpoints.items() if ep.replay is not None]
        waiting.reverse()  # popped from the end: configured order
        timeout = self.replay_timeout

        def open_next() -> None:
            while waiting and len(socks) < MAX_STARTUP_REPLAYS and not self._stop.is_set():
                worker, endpoint = waiting.pop()
                sock = self._ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.connect(endpoint)
                    sock.send_multipart([b"", (0).to_bytes(8, "big")])
                except zmq.ZMQError as exc:
                    self.health.error(SOURCE, "replay", f"worker {worker}: replay from {endpoint} failed: {exc}")
                    sock.close(0)
                    continue
                socks[sock] = worker
                nxt[worker], digests[worker] = 0, {}
                poller.register(sock, zmq.POLLIN)
                now = time.monotonic()
                deadline[sock], hard_end[sock] = now + timeout, now + timeout * REPLAY_TOTAL_TIMEOUTS

        def end(sock: zmq.Socket) -> None:
            self._end_startup(poller, socks, deadline, sock)
            hard_end.pop(sock, None)

        try:
            open_next()
            while socks and not self._stop.is_set():
                now = time.monotonic()
                for sock in [k for k, t in deadline.items() if t <= now]:  # silent too long: give up on it
                    log.warning("worker %s: no complete replay within %.1fs at start", socks[sock], timeout)
                    end(sock)
                open_next()
                if not socks:
                    break
                wait_ms = max(1, int((min(deadline.values()) - now) * 1000))
                for sock, _ in poller.poll(wait_ms):
                    if sock not in socks:
                        continue
                    worker = socks[sock]
                    deadline[sock] = min(time.monotonic() + timeout, hard_end[sock])
                    for _ in range(MAX_DRAIN):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        reply = self._reply(worker, frames)
                        if reply is None:
                            continue
                        seq, payload = reply
                        if seq < 0:
                            end(sock)
                            break
                        if seq < nxt[worker]:
                            continue
                        nxt[worker] = seq + 1
                        digests[worker][seq] = hash(payload)
                        self._decode_and_apply(worker, seq, payload, self.clock())
                open_next()
        finally:
            for sock in list(socks):
                end(sock)
        for worker, seen in digests.items():
            if seen:
                mark = nxt[worker] - 1
                self._next[worker] = mark + 1
                self.replayed_at_start[worker] = self._startup_mark[worker] = mark
                self._startup[worker] = {q: d for q, d in seen.items() if q > mark - STARTUP_DEDUP}
                log.info("worker %s: rebuilt from its replay at start (seq 0..%d)", worker, mark)
        self._startup_until = self.clock() + self.replay_timeout

    @staticmethod
    def _end_startup(poller: zmq.Poller, socks: dict[zmq.Socket, str], deadline: dict[zmq.Socket, float],
                     sock: zmq.Socket) -> None:
        poller.unregister(sock)
        socks.pop(sock, None)
        deadline.pop(sock, None)
        sock.close(0)
