"""A simulated vLLM engine: paged prefix cache, continuous-batching slots and a timing model.

The engine is pure (no I/O): it takes a clock, and reports KV-cache events to a callback.
Requests occupy one of ``max_running`` slots from admission until their last token; a request
that finds every slot busy waits for the earliest one to free (FCFS). Times are modelled, not
slept: :meth:`SimEngine.execute` returns when each phase *will* happen on the clock, and the
engine applies the consequences (blocks visible at prefill end, references dropped at finish,
histograms observed) as the clock reaches them — on the next call, or on :meth:`tick`.

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

EventCallback = Callable[[list[CacheEvent], float], None]


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
    gpus: int = 1
    attention_knee_tokens: float = 32768.0  # context length at which a prompt token costs twice as much
    prefill_overhead_s: float = 0.002  # scheduling and launch cost per request
    spec_tokens: int = 0  # num_speculative_tokens; 0 = speculative decoding off
    spec_acceptance: float = 0.8  # per-position acceptance probability (initial knob value)
    spec_step_overhead: float = 0.05  # extra step time per draft token (share of a plain step)
    expert_signature_blocks: int = 2  # leading blocks that determine the MoE expert signature
    max_model_len: int = 131072
    engine_index: str = "0"  # vLLM's `engine` label (DP engine index)
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
    (a trace block id stands in for a block hash; the last block may hold a partial remainder)."""

    request_id: str
    token_ids: Sequence[int] | None = None
    block_hashes: Sequence[int] | None = None
    prompt_tokens: int | None = None
    max_tokens: int = 16
    output_tokens: int | None = None  # tokens until EOS; None = generate max_tokens
    arrival: float | None = None  # defaults to the clock's now
    expert_signature: str | None = None


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
        self.knobs = Knobs(spec_acceptance=spec.spec_acceptance)
        self.cache = PagedPrefixCache(spec.num_gpu_blocks, spec.block_size)
        self.counters = EngineCounters(created=clock.now())
        self._lock = threading.RLock()
        self._slots: list[float] = []  # end times of requests holding a slot (heap)
        self._inflight: dict[str, tuple[float, float]] = {}  # request id -> (start, end)
        self._due: list[_Due] = []
        self._seq = 0

    # -- read-only ------------------------------------------------------------------------
    def lookup(self, block_hashes: Sequence[int]) -> int:
        """Leading cached blocks for these hashes (the router's belief / "available" tokens)."""
        with self._lock:
            self._advance(self.clock.now())
            return self.cache.match(block_hashes)

    def load(self) -> tuple[int, int]:
        """(running, waiting) at the clock's now."""
        with self._lock:
            now = self.clock.now()
            self._advance(now)
            running = sum(1 for s, e in self._inflight.values() if s <= now < e)
            return running, len(self._inflight) - running

    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            now = self.clock.now()
            running, waiting = self.load()
            c = self.counters
            copy = replace(
                c,
                requests_success=dict(c.requests_success),
                **{k: array("d", getattr(c, k)) for k in _OBSERVATIONS},
            )
            return EngineSnapshot(now, running, waiting, self.cache.usage, self.cache.resident_blocks, copy)

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

    def finish_all(self) -> float:
        """Run every admitted request to completion regardless of the clock; returns the time of
        the last completion (the caller may advance its clock there)."""
        with self._lock:
            last = self.clock.now()
            while self._due:
                last = max(last, self._due[0].t)
                self._advance(self._due[0].t)
            return last

    def reset_cache(self) -> None:
        with self._lock:
            self._emit(self.cache.reset(), self.clock.now())

    def execute(self, req: EngineRequest) -> EngineResult:
        with self._lock:
            return self._execute(req)

    # -- internals ------------------------------------------------------------------------
    def _emit(self, events: list[CacheEvent], ts: float) -> None:
        if events and self.on_events is not None:
            self.on_events(events, ts)

    def _advance(self, t: float) -> None:
        due, c = self._due, self.counters
        while due and due[0].t <= t:
            d = heapq.heappop(due)
            r = d.result
            if d.kind == "commit":
                self._emit(self.cache.commit(r.request_id), d.t)
                c.prompt_tokens += r.prompt_tokens
                c.ttft.append(r.ttft_s)
                c.queue.append(r.queue_s)
                c.prefill.append(r.prefill_s)
                c.prompt_lengths.append(r.prompt_tokens)
            else:
                self.cache.release(r.request_id)
                self._inflight.pop(r.request_id, None)
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
            return len(tokens), chain_hashes(tokens, bs), tokens
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

    def _execute(self, req: EngineRequest) -> EngineResult:
        spec, knobs = self.spec, self.knobs
        if not isinstance(req.request_id, str) or not req.request_id:
            raise RequestError("request_id must be a non-empty string")
        if req.request_id in self._inflight:
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

        now = self.clock.now()
        arrival = now if req.arrival is None else float(req.arrival)
        self._advance(arrival)

        slots = self._slots
        while slots and slots[0] <= arrival:
            heapq.heappop(slots)
        start = arrival if len(slots) < spec.max_running else heapq.heappop(slots)

        bs = spec.block_size
        extra = math.ceil((n + out) / bs) - len(hashes)
        hit_blocks, events = self.cache.acquire(
            req.request_id, hashes, tokens, extra_blocks=extra, max_hit_blocks=(n - 1) // bs
        )
        self._emit(events, arrival)
        cached = hit_blocks * bs
        uncached = n - cached
        context = cached + uncached / 2.0
        prefill_s = (
            spec.prefill_overhead_s
            + uncached / spec.prefill_tps * (1.0 + context / spec.attention_knee_tokens) * knobs.prefill_slowdown
        )
        rng = random.Random(f"{spec.seed}:{spec.name}:{req.request_id}")
        decode_s, drafts, draft_tokens, accepted = self._decode(out, rng)
        queue_s = start - arrival
        result = EngineResult(
            request_id=req.request_id,
            worker=spec.name,
            prompt_tokens=n,
            cached_tokens=cached,
            output_tokens=out,
            finished_reason=reason,
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
            # an affinity-aware scheduler picks waiting requests by their cached prefix
            admitted_by_affinity=knobs.affinity_admission and hit_blocks > 0,
        )
        c = self.counters
        c.prefix_queries += n  # vLLM counts at lookup, in tokens
        c.prefix_hits += cached
        end = start + prefill_s + decode_s
        heapq.heappush(slots, end)
        self._inflight[req.request_id] = (start, end)
        self._push(start + prefill_s, "commit", result)
        self._push(end, "finish", result)
        self._advance(now)
        return result
