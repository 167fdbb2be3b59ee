"""A simulated vLLM engine: paged prefix cache, continuous-batching slots and a timing model.

The engine is pure (no I/O): it takes a clock, and reports KV-cache events to a callback.
Requests occupy one of ``max_running`` slots from admission until their last token. A request
that finds every slot busy waits; when a slot frees at time t the scheduler picks among the
requests that arrived by t: with ``affinity_admission`` on, the longest resident prefix looked
up at t (arrival order among equals), except that a request waiting longer than
``admission_aging_s`` goes first so cold requests cannot starve; off, arrival order (FCFS).
Cache blocks are taken at admission, so a block computed while a request waited can be hit.

Times are modelled, not slept: :meth:`SimEngine.submit` returns the result when a slot was free,
else a :class:`Pending` handle completed when the clock (via :meth:`tick` or any later call)
reaches the admission; :meth:`SimEngine.execute` drives the engine's own schedule ahead until
the request is admitted, for callers that need a result at once. The engine applies the
consequences (blocks visible at prefill end, references dropped at finish, histograms observed)
as the clock reaches them. Handle callbacks run after the engine's lock is released, so they may
call back into the engine or take their own locks.

Timing model (per request):
- prefill = overhead + uncached tokens / prefill_tps × (1 + context / attention_knee_tokens)
  × prefill_slowdown, where context is the average attention span of the uncached tokens, so
  long cold prompts on a slow GPU class are disproportionately slow;
- the first token comes with the prefill; the rest are decoded in steps of 1/decode_tps, each
  step yielding 1 + the accepted draft tokens when speculative decoding is on;
- TTFT = queue + prefill; e2e = TTFT + decode.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from hashlib import blake2b

from fleet.cache import CacheEvent, PagedPrefixCache
from fleet.clock import Clock
from fleet.hashing import chain_hashes
from fleet.residency import DEFAULT_SAMPLE_RATE, Residency, ResidencySampler

EventCallback = Callable[[list[CacheEvent], float], None]
# Told at each admission, before the request takes its blocks: (request id, its full blocks'
# hashes). Runs under the engine's lock: it may read caches, never take another engine's lock.
AdmitCallback = Callable[[str, Sequence[int]], None]

log = logging.getLogger("prefixscope.fleet.engine")


@dataclass(slots=True)
class WorkerSpec:
    name: str
    model: str = "sim-model"
    gpu_class: str = "H100"
    prefill_tps: float = 20000.0  # uncached prompt tokens per second (short context)
    decode_tps: float = 80.0  # decode steps per second per running request
    num_gpu_blocks: int = 8192
    block_size: int = 16
    max_running: int = 32
    # A waiting request older than this is admitted next whatever its prefix (aging against
    # starvation under affinity admission); a few typical prefills, so affinity still reorders.
    admission_aging_s: float = 2.0
    gpus: int = 1
    attention_knee_tokens: float = 32768.0  # context length at which a prompt token costs twice as much
    prefill_overhead_s: float = 0.002  # scheduling and launch cost per request
    spec_tokens: int = 0  # num_speculative_tokens; 0 = speculative decoding off
    spec_acceptance: float = 0.8  # per-position acceptance probability (initial knob value)
    spec_step_overhead: float = 0.05  # extra step time per draft token (share of a plain step)
    expert_signature_blocks: int = 2  # leading blocks that determine the MoE expert signature
    max_model_len: int = 131072
    engine_index: str = "0"  # vLLM's `engine` label (DP engine index)
    # vLLM's --kv-cache-metrics (sampled block residency histograms on /metrics; absent when off)
    # and --kv-cache-metrics-sample (the share of blocks followed)
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = DEFAULT_SAMPLE_RATE
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a worker needs a name")
        for attr in ("prefill_tps", "decode_tps", "attention_knee_tokens"):
            if getattr(self, attr) <= 0:
                raise ValueError(f"{attr} must be positive")
        if self.num_gpu_blocks <= 0 or self.block_size <= 0 or self.max_running <= 0:
            raise ValueError("num_gpu_blocks, block_size and max_running must be positive")
        if self.spec_tokens < 0:
            raise ValueError("spec_tokens must be ≥ 0")
        if self.admission_aging_s < 0:
            raise ValueError("admission_aging_s must be ≥ 0")
        if self.kv_cache_metrics and not 0.0 < self.kv_cache_metrics_sample <= 1.0:
            raise ValueError("kv_cache_metrics_sample must be in (0, 1]")


@dataclass(slots=True)
class Knobs:
    """Fault-injection switches, flipped at runtime by scenarios."""

    prefill_slowdown: float = 1.0
    spec_acceptance: float = 0.8
    expert_misalignment: float = 0.0
    affinity_admission: bool = True
    drop_kv_events: float = 0.0
    healthy: bool = True


@dataclass(slots=True)
class EngineRequest:
    """One request. Give ``token_ids``, or ``block_hashes`` + ``prompt_tokens`` for trace replay
    (a trace block id stands in for a block hash; the last block may hold a partial remainder),
    or both ``token_ids`` and the ``block_hashes`` of their full blocks when the caller hashed
    them already (the reference router: the engine publishes the tokens without hashing again).
    ``lora_name``/``lora_id``: the LoRA adapter it runs on, published with its blocks;
    ``cache_salt``: vLLM's request field, published in the first block's ``extra_keys``."""

    request_id: str
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None
    prompt_tokens: int | None = None
    max_tokens: int = 16
    output_tokens: int | None = None  # tokens until EOS; None = generate max_tokens
    arrival: float | None = None  # defaults to the clock's now
    expert_signature: str | None = None
    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None


@dataclass(slots=True)
class EngineResult:
    request_id: str
    worker: str
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    finished_reason: str
    arrival: float
    queue_s: float
    prefill_s: float
    decode_s: float
    ttft_s: float
    e2e_s: float
    block_hashes: list[int]
    hit_blocks: int
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    expert_signature: str | None = None
    admitted_by_affinity: bool = False

    @property
    def first_token_at(self) -> float:
        return self.arrival + self.ttft_s

    @property
    def finished_at(self) -> float:
        return self.arrival + self.e2e_s


ResultCallback = Callable[[EngineResult], None]


class Pending:
    """A submitted request still waiting for a slot; completed at its admission."""

    __slots__ = ("_callbacks", "_event", "_lock", "arrival", "request_id", "result")

    def __init__(self, request_id: str, arrival: float) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.result: EngineResult | None = None  # set at admission (under the engine's lock)
        self._event = threading.Event()
        self._callbacks: list[ResultCallback] = []
        self._lock = threading.Lock()

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> EngineResult | None:
        """The result once admitted, or None if ``timeout`` passed first."""
        self._event.wait(timeout)
        return self.result if self._event.is_set() else None

    def add_done_callback(self, fn: ResultCallback) -> None:
        """Call ``fn(result)`` at admission (at once if the request was already admitted)."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        fn(self.result)  # type: ignore[arg-type]

    def _complete(self) -> None:
        with self._lock:
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn(self.result)  # type: ignore[arg-type]
            except Exception:  # one consumer's failure must not stop the engine's clock
                log.exception("admission callback for %s failed", self.request_id)


@dataclass(slots=True)
class QueuedRequest:
    """A validated request in the waiting queue."""

    req: EngineRequest
    handle: Pending
    seq: int  # submission order: breaks ties between equal arrivals
    prompt_tokens: int
    hashes: list[int]
    tokens: Sequence[int] | None
    output_tokens: int
    reason: str
    max_hit: int  # hit blocks at most (the last-token rule)


@dataclass(slots=True)
class EngineCounters:
    """Cumulative values that a worker's /metrics renders (vLLM semantics: tokens, not blocks)."""

    created: float
    prefix_queries: int = 0
    prefix_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    requests_success: dict[str, int] = field(default_factory=dict)  # finished_reason -> count
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # per-request observations (seconds) for the latency histograms
    ttft: array = field(default_factory=lambda: array("d"))
    queue: array = field(default_factory=lambda: array("d"))
    prefill: array = field(default_factory=lambda: array("d"))
    decode: array = field(default_factory=lambda: array("d"))
    inference: array = field(default_factory=lambda: array("d"))
    e2e: array = field(default_factory=lambda: array("d"))
    prompt_lengths: array = field(default_factory=lambda: array("d"))
    generation_lengths: array = field(default_factory=lambda: array("d"))


@dataclass(slots=True)
class EngineSnapshot:
    """A consistent copy of what /metrics shows, taken under the engine's lock."""

    at: float
    running: int
    waiting: int
    kv_usage: float
    resident_blocks: int
    counters: EngineCounters
    residency: Residency | None = None  # None: the engine runs without --kv-cache-metrics


_OBSERVATIONS = ("ttft", "queue", "prefill", "decode", "inference", "e2e", "prompt_lengths", "generation_lengths")


class RequestError(ValueError):
    """A request the engine cannot run (the HTTP layer turns it into a 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(order=True, slots=True)
class _Due:
    t: float
    seq: int
    kind: str = field(compare=False)  # "commit" | "finish"
    result: EngineResult = field(compare=False)
    start: float = field(compare=False, default=0.0)


class SimEngine:
    def __init__(self, spec: WorkerSpec, clock: Clock, on_events: EventCallback | None = None) -> None:
        self.spec = spec
        self.clock = clock
        self.on_events = on_events
        self.on_admit: AdmitCallback | None = None
        self.knobs = Knobs(spec_acceptance=spec.spec_acceptance)
        sampler = (ResidencySampler(spec.kv_cache_metrics_sample, seed=f"{spec.seed}:{spec.name}")
                   if spec.kv_cache_metrics else None)
        self.cache = PagedPrefixCache(spec.num_gpu_blocks, spec.block_size, residency=sampler)
        self.counters = EngineCounters(created=clock.now())
        self._lock = threading.RLock()
        self._running = 0  # admitted and not finished, in the engine's own schedule
        self._inflight: dict[str, tuple[float, float]] = {}  # admitted request id -> (start, end)
        self._ends: list[tuple[float, str]] = []  # (end, request id) heap, to forget finished ones
        self._waiting: list[QueuedRequest] = []  # in arrival order
        self._waiting_ids: set[str] = set()
        self._admitted: list[Pending] = []  # admitted since the last _fire
        self._due: list[_Due] = []
        self._seq = 0

    # -- read-only ------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Leading cached blocks for these hashes (the router's belief / "available" tokens)."""
        with self._lock:
            self._advance(self.clock.now())
            m = self.cache.match(block_hashes)
        self._fire()
        return m

    def load(self) -> tuple[int, int]:
        """(running, waiting) at the clock's now."""
        with self._lock:
            counts = self._load(self.clock.now())
        self._fire()
        return counts

    def _load(self, now: float) -> tuple[int, int]:
        self._advance(now)
        self._forget(now)
        running = sum(1 for s, e in self._inflight.values() if s <= now < e)
        return running, len(self._inflight) - running + len(self._waiting)

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            now = self.clock.now()
            running, waiting = self._load(now)
            c = self.counters
            copy = replace(
                c,
                requests_success=dict(c.requests_success),
                **{k: array("d", getattr(c, k)) for k in _OBSERVATIONS},
            )
            sampler = self.cache.residency
            snap = EngineSnapshot(now, running, waiting, self.cache.usage, self.cache.resident_blocks, copy,
                                  sampler.histograms.copy() if sampler is not None else None)
        self._fire()
        return snap

    @property
    def kv_usage(self) -> float:
        with self._lock:
            return self.cache.usage

    def hashes_for(self, token_ids: Sequence[int]) -> list[int]:
        return chain_hashes(token_ids, self.spec.block_size)

    # -- lifecycle ------------------------------------------------------------------------
    def tick(self) -> None:
        """Apply everything that is due on the clock (the real-time fleet calls this often)."""
        with self._lock:
            self._advance(self.clock.now())
        self._fire()

    def finish_all(self) -> float:
        """Run every request, waiting ones included, to completion regardless of the clock;
        returns the time of the last completion (the caller may advance its clock there)."""
        with self._lock:
            last = self.clock.now()
            while self._due:
                last = max(last, self._due[0].t)
                self._advance(self._due[0].t)
        self._fire()
        return last

    def reset_cache(self) -> None:
        with self._lock:
            self._emit(self.cache.reset(), self.clock.now())

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._waiting)

    def submit(self, req: EngineRequest) -> EngineResult | Pending:
        """Admit ``req`` if a slot is free at its arrival (its result), else queue it (a handle).

        Raises :class:`RequestError` at once for a request the engine cannot run.
        """
        with self._lock:
            handle = self._submit(req)
        self._fire()
        return handle.result if handle.result is not None else handle

    def execute(self, req: EngineRequest) -> EngineResult:
        """Submit and, if the request must wait, run the engine's schedule ahead of the clock
        until it is admitted (the engine applies due work as its own time passes; the clock
        itself is not moved)."""
        with self._lock:
            handle = self._submit(req)
            while handle.result is None and self._due:
                self._advance(self._due[0].t)
        self._fire()
        if handle.result is None:  # a waiting request implies a running one, so a due finish
            raise RuntimeError(f"request {req.request_id!r} was never admitted")
        return handle.result

    # -- internals ------------------------------------------------------------------------
    def _emit(self, events: list[CacheEvent], ts: float) -> None:
        if events and self.on_events is not None:
            self.on_events(events, ts)

    def _fire(self) -> None:
        """Complete the handles admitted so far, outside the engine's lock."""
        if not self._admitted:
            return
        with self._lock:
            ready, self._admitted = self._admitted, []
        for handle in ready:
            handle._complete()

    def _forget(self, now: float) -> None:
        ends, inflight = self._ends, self._inflight
        while ends and ends[0][0] <= now:
            end, rid = heapq.heappop(ends)
            if inflight.get(rid, (0.0, -1.0))[1] == end:
                del inflight[rid]

    def _advance(self, t: float) -> None:
        """Apply the due work up to ``t``; every time slots free, admit waiting requests."""
        due = self._due
        while due and due[0].t <= t:
            t0 = due[0].t
            while due and due[0].t == t0:  # all that happens at t0, before anyone is admitted
                self._apply(heapq.heappop(due))
            if self._waiting:
                self._admit(t0)

    def _apply(self, d: _Due) -> None:
        c, r = self.counters, d.result
        if d.kind == "commit":
            self._emit(self.cache.commit(r.request_id), d.t)
            c.prompt_tokens += r.prompt_tokens
            c.ttft.append(r.ttft_s)
            c.queue.append(r.queue_s)
            c.prefill.append(r.prefill_s)
            c.prompt_lengths.append(r.prompt_tokens)
        else:
            self.cache.release(r.request_id)
            self._running -= 1
            c.generation_tokens += r.output_tokens
            c.requests_success[r.finished_reason] = c.requests_success.get(r.finished_reason, 0) + 1
            c.spec_drafts += r.spec_drafts
            c.spec_draft_tokens += r.spec_draft_tokens
            c.spec_accepted_tokens += r.spec_accepted_tokens
            c.decode.append(r.decode_s)
            c.inference.append(r.prefill_s + r.decode_s)
            c.e2e.append(r.e2e_s)
            c.generation_lengths.append(r.output_tokens)

    def _push(self, t: float, kind: str, result: EngineResult) -> None:
        self._seq += 1
        heapq.heappush(self._due, _Due(t, self._seq, kind, result))

    def _prompt(self, req: EngineRequest) -> tuple[int, list[int], Sequence[int] | None]:
        bs = self.spec.block_size
        if req.token_ids is not None:
            tokens = req.token_ids
            if not tokens:
                raise RequestError("the prompt is empty", "prompt")
            if req.block_hashes is None:
                return len(tokens), chain_hashes(tokens, bs), tokens
            if len(req.block_hashes) != len(tokens) // bs:
                raise RequestError(f"{len(req.block_hashes)} block hashes for {len(tokens)} tokens "
                                   f"(block size {bs})", "prompt")
            return len(tokens), list(req.block_hashes), tokens
        if req.block_hashes is None or req.prompt_tokens is None:
            raise RequestError("a request needs token_ids, or block_hashes and prompt_tokens", "prompt")
        n = int(req.prompt_tokens)
        if n <= 0:
            raise RequestError("prompt_tokens must be positive", "prompt")
        full = n // bs
        return n, [int(h) for h in req.block_hashes[:full]], None

    def _signature(self, req: EngineRequest, hashes: list[int], n: int, rng: random.Random) -> str:
        if req.expert_signature is not None:
            base = req.expert_signature
        else:
            h = blake2b(digest_size=4)
            lead = hashes[: self.spec.expert_signature_blocks]
            h.update(repr(lead if lead else n).encode())
            base = "e" + h.hexdigest()
        if self.knobs.expert_misalignment > 0 and rng.random() < self.knobs.expert_misalignment:
            return f"{base}~{rng.getrandbits(16):04x}"
        return base

    def _decode(self, out: int, rng: random.Random) -> tuple[float, int, int, int]:
        """(decode seconds, drafts, draft tokens, accepted tokens) for ``out`` output tokens."""
        rest = max(0, out - 1)  # the first token comes with the prefill
        k = self.spec.spec_tokens
        base_step = 1.0 / self.spec.decode_tps
        if k == 0 or rest == 0:
            return rest * base_step, 0, 0, 0
        p = min(1.0, max(0.0, self.knobs.spec_acceptance))
        steps = accepted = produced = 0
        rand = rng.random
        while produced < rest:
            a = 0
            while a < k and rand() < p:
                a += 1
            emit = min(a + 1, rest - produced)
            accepted += min(a, emit)
            produced += emit
            steps += 1
        step_s = base_step * (1.0 + self.spec.spec_step_overhead * k)
        return steps * step_s, steps, steps * k, accepted

    def _submit(self, req: EngineRequest) -> Pending:
        spec = self.spec
        if not isinstance(req.request_id, str) or not req.request_id:
            raise RequestError("request_id must be a non-empty string")
        now = self.clock.now()
        arrival = now if req.arrival is None else float(req.arrival)
        self._forget(min(now, arrival))
        if req.request_id in self._inflight or req.request_id in self._waiting_ids:
            raise RequestError(f"request {req.request_id!r} is already running")
        n, hashes, tokens = self._prompt(req)
        max_tokens = int(req.max_tokens)
        if max_tokens < 1:
            raise RequestError("max_tokens must be at least 1", "max_tokens")
        if n + max_tokens > spec.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
                f"maximum context length ({spec.max_model_len})",
                "max_tokens",
            )
        if req.output_tokens is not None and int(req.output_tokens) < max_tokens:
            out, reason = max(1, int(req.output_tokens)), "stop"
        else:
            out, reason = max_tokens, "length"

        self._advance(arrival)
        self._seq += 1
        w = QueuedRequest(req, Pending(req.request_id, arrival), self._seq, n, hashes, tokens, out, reason,
                     (n - 1) // spec.block_size)
        queue = self._waiting
        if queue and queue[-1].handle.arrival > arrival:  # out of order (rare): keep arrival order
            i = len(queue)
            while i and queue[i - 1].handle.arrival > arrival:
                i -= 1
            queue.insert(i, w)
        else:
            queue.append(w)
        self._waiting_ids.add(req.request_id)
        self._admit(arrival)
        self._advance(now)
        return w.handle

    def _admit(self, t: float) -> None:
        """Fill free slots at ``t`` from the requests that arrived by then."""
        queue, cap = self._waiting, self.spec.max_running
        while self._running < cap and queue and queue[0].handle.arrival <= t:
            i, forced = self._pick(t)
            w = queue.pop(i)
            self._waiting_ids.discard(w.req.request_id)
            self._start(w, t, forced)

    def _pick(self, t: float) -> tuple[int, bool]:
        """(index in the waiting queue, admitted by the aging bound) of the next admission."""
        queue = self._waiting
        if not self.knobs.affinity_admission or len(queue) == 1:
            return 0, False
        if t - queue[0].handle.arrival > self.spec.admission_aging_s:
            return 0, True
        match = self.cache.match
        best_i, best = 0, -1
        for i, w in enumerate(queue):
            if w.handle.arrival > t:
                break
            m = min(match(w.hashes), w.max_hit)
            if m > best:  # strictly longer: arrival order among equals
                best_i, best = i, m
                if m == w.max_hit and i == 0:
                    break  # the oldest request with its whole prefix resident: nobody beats it
        return best_i, False

    def _start(self, w: QueuedRequest, t: float, forced: bool) -> None:
        """Admit a waiting request at ``t``: take its blocks, model its times, schedule its work."""
        spec, knobs, req = self.spec, self.knobs, w.req
        n, hashes, out = w.prompt_tokens, w.hashes, w.output_tokens
        bs = spec.block_size
        extra = math.ceil((n + out) / bs) - len(hashes)
        if self.on_admit is not None:
            self.on_admit(req.request_id, hashes)
        hit_blocks, events = self.cache.acquire(
            req.request_id, hashes, w.tokens, extra_blocks=extra, max_hit_blocks=w.max_hit,
            lora_id=req.lora_id, lora_name=req.lora_name, cache_salt=req.cache_salt, at=t,
        )
        self._emit(events, t)
        cached = hit_blocks * bs
        uncached = n - cached
        context = cached + uncached / 2.0
        prefill_s = (
            spec.prefill_overhead_s
            + uncached / spec.prefill_tps * (1.0 + context / spec.attention_knee_tokens) * knobs.prefill_slowdown
        )
        rng = random.Random(f"{spec.seed}:{spec.name}:{req.request_id}")
        decode_s, drafts, draft_tokens, accepted = self._decode(out, rng)
        arrival = w.handle.arrival
        queue_s = t - arrival
        result = EngineResult(
            request_id=req.request_id,
            worker=spec.name,
            prompt_tokens=n,
            cached_tokens=cached,
            output_tokens=out,
            finished_reason=w.reason,
            arrival=arrival,
            queue_s=queue_s,
            prefill_s=prefill_s,
            decode_s=decode_s,
            ttft_s=queue_s + prefill_s,
            e2e_s=queue_s + prefill_s + decode_s,
            block_hashes=hashes,
            hit_blocks=hit_blocks,
            spec_drafts=drafts,
            spec_draft_tokens=draft_tokens,
            spec_accepted_tokens=accepted,
            expert_signature=self._signature(req, hashes, n, rng),
            # Chosen for its resident prefix: the pick is by prefix, so a request with one was
            # either picked ahead of earlier arrivals or had none ahead of it; an aging-forced
            # admission was not chosen for its prefix.
            admitted_by_affinity=knobs.affinity_admission and hit_blocks > 0 and not forced,
        )
        c = self.counters
        c.prefix_queries += n  # vLLM counts at lookup, in tokens
        c.prefix_hits += cached
        end = t + prefill_s + decode_s
        self._running += 1
        self._inflight[req.request_id] = (t, end)
        heapq.heappush(self._ends, (end, req.request_id))
        self._push(t + prefill_s, "commit", result)
        self._push(end, "finish", result)
        w.handle.result = result
        self._admitted.append(w.handle)
