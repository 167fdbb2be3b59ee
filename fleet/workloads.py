"""Synthetic workloads: a time-ordered stream of requests with real token ids and block hashes.

Streams (each a Poisson process whose rate comes from the phase active at the time):
- chat sessions: a few tenants, each with a long shared system prompt plus tool descriptions;
  every follow-up turn extends the previous context (prompt + answer + new user message);
- cold sessions: a system prompt of their own (nothing shared) — a burst of new sessions;
- document analysis: one long unique document per request, a summary-length answer; or, with
  ``doc_pool``, questions about the documents of a fixed corpus, each document under its own
  session key (the same document comes back, asked something new);
- document Q&A: a shared document asked several questions by keyless API calls (each call
  resends document + question; only the document is shared);
- extraction jobs: a long unique document and a very short answer (the async-prefill kind);
- session-key churn: a follow-up continues under a new key (``cookie``: a fresh key, as after
  a cookie reset or a device hand-off; ``title``: only the key's tail changes);
- forks: a new session that starts from another session's whole context (a sub-agent).

A workload is a list of phases ``(start_s, WorkloadParams)``; a scenario switches phases at
its fault time. Generation is pure and seeded: the same phases and seed give the same stream.
Block hashes are computed incrementally per conversation (only new blocks are hashed).

Prompts are readable text (``fleet/prompt_text.py``: "Acme billing assistant …", "5d01b7aa:
Can you check …", "Report 3fa9c2e1: summarise …") tokenized by the byte-level
``fleet/tokenizer.py``, so a worker's ``/detokenize`` turns the tokens of a KV event back into
words. A tenant may run on a LoRA adapter (``tenant_loras``); its requests carry the adapter's
name and id the way vLLM's KV events do. A tenant may also send a ``cache_salt``
(``tenant_salts``), which vLLM mixes into the first block's hash and lists in its
``extra_keys`` (the simulated hashes leave it out: tenants' system prompts differ anyway).
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from itertools import pairwise
from typing import Any

from fleet import prompt_text as text
from fleet.hashing import chain_hashes
from fleet.tokenizer import encode

TIMESTAMP_TOKENS = 16  # "08:05:01.123456\n": the time of day, to the microsecond, fills the first block
DAY_START_S = 8 * 3600.0  # t = 0 is 08:00:00 on the rendered clock


@dataclass(frozen=True, slots=True)
class WorkloadParams:
    chat_sessions_per_s: float = 0.5
    tenants: int = 4  # distinct shared system prompts
    system_tokens: int = 3000
    tool_tokens: int = 1000
    turns: tuple[int, int] = (3, 8)
    think_s: float = 20.0  # mean gap between a session's turns
    user_tokens: tuple[int, int] = (40, 240)
    output_tokens: tuple[int, int] = (80, 320)
    cold_sessions_per_s: float = 0.02  # sessions with a system prompt of their own
    cold_prompt_tokens: tuple[int, int] = (3000, 5000)
    cold_turns: tuple[int, int] = (3, 8)
    cold_output_tokens: tuple[int, int] = (80, 320)
    doc_per_s: float = 0.02
    doc_tokens: tuple[int, int] = (8000, 20000)
    doc_output_tokens: tuple[int, int] = (200, 600)
    # > 0: document analysis draws (uniformly) from a corpus of this many documents, each asked
    # again and again under its own session key; 0: every document is new and asked once
    doc_pool: int = 0
    docqa_per_s: float = 0.01  # shared documents questioned by keyless API calls (RAG-style)
    docqa_tokens: tuple[int, int] = (4000, 8000)
    docqa_questions: tuple[int, int] = (3, 8)
    docqa_gap_s: float = 10.0
    docqa_output_tokens: tuple[int, int] = (100, 300)
    extract_per_s: float = 0.01
    extract_tokens: tuple[int, int] = (10000, 14000)
    extract_output_tokens: tuple[int, int] = (4, 24)
    rekey_prob: float = 0.0  # per follow-up turn
    rekey_mode: str = "cookie"  # cookie | title
    rekey_segments: tuple[str, ...] = ("web", "mobile")
    fork_prob: float = 0.0  # per follow-up turn: a sub-agent session starts from this context
    timestamp_in_system_prompt: bool = False
    timestamp_segments: tuple[str, ...] = ("web", "mobile", "api")  # whose template renders it
    segments: tuple[tuple[str, float], ...] = (("web", 0.5), ("mobile", 0.3), ("api", 0.2))
    tenant_loras: tuple[str | None, ...] = ()  # LoRA adapter name by tenant index (None/missing: none)
    tenant_salts: tuple[str | None, ...] = ()  # cache_salt by tenant index (None/missing: none)

    def with_overrides(self, overrides: Mapping[str, Any]) -> WorkloadParams:
        return replace(self, **dict(overrides))


WORKLOAD_FIELDS = {f.name for f in fields(WorkloadParams)}


@dataclass(slots=True)
class SimRequest:
    t: float  # seconds since the start of the run
    request_id: str
    session_key: str | None
    conversation: str  # ground truth (never exported): the conversation this continues
    turn: int  # 1 for the first request of a conversation
    prompt_tokens: int
    block_hashes: list[int]
    output_tokens: int
    segment: str | None
    kind: str  # chat | cold | doc | docqa | extract | fork | trace
    block_size: int = 16
    token_ids: list[int] | None = None
    lora_name: str | None = None  # the LoRA adapter the request runs on (vLLM's lora_name)
    lora_id: int | None = None  # its integer id (vLLM's deprecated lora_id)
    cache_salt: str | None = None  # the request's cache_salt (its tenant's)


@dataclass(slots=True)
class _Session:
    conversation: str
    key: str
    segment: str
    ctx: list[int]
    ctx_hashes: list[int]  # hashes of the full blocks of ctx
    turns_left: int
    turn: int = 0
    kind: str = "chat"
    out_range: tuple[int, int] = (80, 320)
    extend: bool = True  # follow-ups extend the context (chat) or resend it (document Q&A)
    user: str | None = None  # the id its user turns are signed with (from its first turn)
    lora: tuple[str | None, int | None] = (None, None)
    salt: str | None = None
    extra: dict = field(default_factory=dict)


@dataclass(slots=True)
class _Document:
    """A document of the corpus (``doc_pool``): its session key, tokens, block hashes, visits so far."""

    key: str
    token_ids: list[int]
    block_hashes: list[int]
    visits: int = 0


@dataclass(frozen=True, slots=True)
class SharedPrompt:
    """A tenant's system prompt + tools: what operators pre-warm on every worker."""

    token_ids: list[int]
    block_hashes: list[int]
    lora_name: str | None = None
    lora_id: int | None = None
    cache_salt: str | None = None


Phases = Sequence[tuple[float, WorkloadParams]]


class WorkloadGenerator:
    """Iterate :meth:`requests` for the stream; phases must start at 0 and be in order."""

    def __init__(self, phases: Phases, duration_s: float, seed: int = 0, block_size: int = 16,
                 keep_tokens: bool = True) -> None:
        if not phases or phases[0][0] != 0:
            raise ValueError("the first workload phase must start at 0")
        if any(b[0] < a[0] for a, b in pairwise(phases)):
            raise ValueError("workload phases must be in time order")
        self.phases = list(phases)
        self.duration_s = duration_s
        self.bs = block_size
        self.keep_tokens = keep_tokens
        self.rng = random.Random(seed)
        self._seq = 0
        self._ids = 0
        self._tenant_cache: dict[int, tuple[list[int], list[int]]] = {}
        self._corpus: dict[int, _Document] = {}  # doc_pool index -> the document, once visited

    # -- helpers --------------------------------------------------------------------------
    def params(self, t: float) -> WorkloadParams:
        p = self.phases[0][1]
        for start, params in self.phases:
            if start <= t:
                p = params
        return p

    def _next_boundary(self, t: float) -> float:
        for start, _ in self.phases:
            if start > t:
                return start
        return float("inf")

    def _raw(self, n: int) -> bytes:
        """``n`` random bytes: the text of ``n`` tokens is chosen by them (one draw per token, so
        the stream's randomness is spent the same way whatever the text)."""
        return self.rng.randbytes(max(0, n))

    def _text(self, render: Callable[[bytes, int], str], n: int) -> list[int]:
        """Tokens of ``render(random bytes, n)``: exactly ``n`` of them (the text is ASCII)."""
        return encode(render(self._raw(n), n))

    @staticmethod
    def _lora(i: int, p: WorkloadParams) -> tuple[str | None, int | None]:
        """(name, id) of tenant ``i``'s LoRA adapter; the id numbers adapters from 1 in list order."""
        name = p.tenant_loras[i] if i < len(p.tenant_loras) else None
        if not name:
            return None, None
        return name, p.tenant_loras.index(name) + 1

    @staticmethod
    def _salt(i: int, p: WorkloadParams) -> str | None:
        """Tenant ``i``'s cache_salt."""
        return (p.tenant_salts[i] if i < len(p.tenant_salts) else None) or None

    def _between(self, lo_hi: tuple[int, int]) -> int:
        lo, hi = lo_hi
        return self.rng.randint(lo, max(lo, hi))

    def _new_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids:06d}-{self.rng.getrandbits(32):08x}"

    def _segment(self, p: WorkloadParams) -> str:
        names = [s for s, _ in p.segments]
        return self.rng.choices(names, weights=[w for _, w in p.segments])[0]

    def _tenant(self, i: int, p: WorkloadParams) -> tuple[list[int], list[int]]:
        if i not in self._tenant_cache:
            toks = encode(text.tenant_prompt(i, p.system_tokens, p.tool_tokens))
            self._tenant_cache[i] = (toks, chain_hashes(toks, self.bs))
        return self._tenant_cache[i]

    def shared_prefixes(self) -> list[list[int]]:
        """Block hashes of every tenant's shared system prompt + tools (first phase's tenants)."""
        return [s.block_hashes for s in self.shared_prompts()]

    def shared_prompts(self) -> list[SharedPrompt]:
        """Every tenant's shared system prompt + tools (first phase's tenants), for pre-warming."""
        p = self.phases[0][1]
        return [SharedPrompt(*self._tenant(i, p), *self._lora(i, p), self._salt(i, p)) for i in range(p.tenants)]

    def _extend(self, ctx_hashes: list[int], prompt: list[int]) -> list[int]:
        """Hashes of the full blocks of ``prompt``, reusing those known for its prefix."""
        known = ctx_hashes
        start = len(known) * self.bs
        parent = known[-1] if known else None
        return known + chain_hashes(prompt[start:], self.bs, parent)

    # -- the stream -----------------------------------------------------------------------
    def requests(self) -> Iterator[SimRequest]:
        heap: list[tuple[float, int, str, Any]] = []

        def push(t: float, kind: str, payload: Any = None) -> None:
            if t <= self.duration_s:
                self._seq += 1
                heapq.heappush(heap, (t, self._seq, kind, payload))

        rates = {"chat": "chat_sessions_per_s", "cold": "cold_sessions_per_s", "doc": "doc_per_s",
                 "extract": "extract_per_s", "docqa": "docqa_per_s"}

        def schedule(stream: str, t: float) -> None:
            while t <= self.duration_s:
                rate = getattr(self.params(t), rates[stream])
                boundary = self._next_boundary(t)
                if rate <= 0:
                    t = boundary
                    continue
                nt = t + self.rng.expovariate(rate)
                if nt < boundary:
                    push(nt, "arrive", stream)
                    return
                t = boundary

        for s in rates:
            schedule(s, 0.0)
        while heap:
            t, _, kind, payload = heapq.heappop(heap)
            p = self.params(t)
            if kind == "arrive":
                schedule(payload, t)
                if payload in ("doc", "extract"):
                    yield self._single(t, payload, p)
                    continue
                sess = self._new_docqa(p) if payload == "docqa" else self._new_session(payload, p)
                kind, payload = "turn", sess
            if kind == "turn":
                req, again = self._turn(t, payload, p, push)
                yield req
                if again:
                    gap = p.docqa_gap_s if not payload.extend else p.think_s
                    push(t + gap * self.rng.uniform(0.5, 1.5), "turn", payload)

    def _new_session(self, stream: str, p: WorkloadParams, ctx: list[int] | None = None,
                     ctx_hashes: list[int] | None = None, turns: int | None = None) -> _Session:
        lora: tuple[str | None, int | None] = (None, None)
        salt: str | None = None
        if ctx is None:
            if stream == "chat":
                tenant = self.rng.randrange(max(1, p.tenants))
                ctx, ctx_hashes = self._tenant(tenant, p)
                ctx, ctx_hashes = list(ctx), list(ctx_hashes)
                lora, salt = self._lora(tenant, p), self._salt(tenant, p)
            else:  # a system prompt nobody shares: nothing to reuse anywhere
                ctx = self._text(text.cold_system_prompt, self._between(p.cold_prompt_tokens))
                ctx_hashes = chain_hashes(ctx, self.bs)
        out_range = p.cold_output_tokens if stream == "cold" else p.output_tokens
        return _Session(conversation=self._new_id("c"), key=self._new_id("s"), segment=self._segment(p),
                        ctx=ctx, ctx_hashes=ctx_hashes or [],
                        turns_left=turns or self._between(p.cold_turns if stream == "cold" else p.turns),
                        kind=stream, out_range=out_range, lora=lora, salt=salt)

    def _new_docqa(self, p: WorkloadParams) -> _Session:
        doc = self._text(text.manual, self._between(p.docqa_tokens))
        return _Session(conversation=self._new_id("c"), key="", segment="api", ctx=doc,
                        ctx_hashes=chain_hashes(doc, self.bs), turns_left=self._between(p.docqa_questions),
                        kind="docqa", out_range=p.docqa_output_tokens, extend=False)

    def _turn(self, t: float, s: _Session, p: WorkloadParams, push: Any) -> tuple[SimRequest, bool]:
        s.turn += 1
        s.turns_left -= 1
        if s.turn > 1 and s.key and s.segment in p.rekey_segments and self.rng.random() < p.rekey_prob:
            s.key = s.key[:-4] + f"{self.rng.getrandbits(16):04x}" if p.rekey_mode == "title" else self._new_id("s")
        n = self._between(p.user_tokens)
        raw = self._raw(n)
        if s.extend:
            if s.user is None:
                s.user = text.random_id(raw)
            prompt = s.ctx + encode(text.user_turn(raw, n, s.user))
        else:  # a question about the shared document
            prompt = s.ctx + encode(text.question(raw, n))
        hashes = self._extend(s.ctx_hashes, prompt)
        out = self._between(s.out_range)
        if p.timestamp_in_system_prompt and s.segment in p.timestamp_segments:
            # The rendered prompt starts with the current time: every block's chain changes.
            sent = encode(clock_text(t)) + prompt
            sent_hashes = chain_hashes(sent, self.bs)
        else:
            sent, sent_hashes = prompt, hashes
        self._ids += 1
        req = SimRequest(t=t, request_id=f"r{self._ids:07d}", session_key=s.key or None, conversation=s.conversation,
                         turn=s.turn, prompt_tokens=len(sent), block_hashes=sent_hashes, output_tokens=out,
                         segment=s.segment, kind=s.kind, block_size=self.bs,
                         token_ids=sent if self.keep_tokens else None, lora_name=s.lora[0], lora_id=s.lora[1],
                         cache_salt=s.salt)
        if not s.extend:
            return req, s.turns_left > 0
        s.ctx = prompt + self._text(text.answer, out)
        s.ctx_hashes = hashes
        if s.turn > 1 and self.rng.random() < p.fork_prob:
            fork = self._new_session("chat", p, list(s.ctx), list(hashes), turns=self._between((1, 3)))
            fork.kind, fork.lora, fork.salt = "fork", s.lora, s.salt
            push(t + p.think_s * self.rng.uniform(0.1, 0.5), "turn", fork)
        return req, s.turns_left > 0

    def _pooled_doc(self, t: float, p: WorkloadParams) -> SimRequest:
        """A new question about one document of the corpus: the document (the same tokens every
        time, generated on its first visit) and the question, under the document's session key."""
        i = self.rng.randrange(p.doc_pool)
        if i not in self._corpus:
            toks = self._text(text.report, self._between(p.doc_tokens))
            self._corpus[i] = _Document(self._new_id("d"), toks, chain_hashes(toks, self.bs))
        doc = self._corpus[i]
        doc.visits += 1
        n = self._between(p.user_tokens)
        prompt = doc.token_ids + encode(text.question(self._raw(n), n))
        self._ids += 1
        return SimRequest(t=t, request_id=f"r{self._ids:07d}", session_key=doc.key, conversation=doc.key,
                          turn=doc.visits, prompt_tokens=len(prompt), block_hashes=self._extend(doc.block_hashes, prompt),
                          output_tokens=self._between(p.doc_output_tokens), segment="api", kind="doc",
                          block_size=self.bs, token_ids=prompt if self.keep_tokens else None)

    def _single(self, t: float, stream: str, p: WorkloadParams) -> SimRequest:
        if stream == "doc" and p.doc_pool > 0:
            return self._pooled_doc(t, p)
        lo_hi, out_range = ((p.doc_tokens, p.doc_output_tokens) if stream == "doc"
                            else (p.extract_tokens, p.extract_output_tokens))
        toks = self._text(text.report if stream == "doc" else text.invoice, self._between(lo_hi))
        self._ids += 1
        return SimRequest(t=t, request_id=f"r{self._ids:07d}", session_key=self._new_id("d"),
                          conversation=self._new_id("c"), turn=1, prompt_tokens=len(toks),
                          block_hashes=chain_hashes(toks, self.bs), output_tokens=self._between(out_range),
                          segment="api", kind=stream, block_size=self.bs,
                          token_ids=toks if self.keep_tokens else None)


def clock_text(t: float) -> str:
    """``t`` seconds into the run as a time of day to the microsecond: "08:05:01.123456\\n"
    (TIMESTAMP_TOKENS characters, so the whole first block differs from one request to the next)."""
    s = (DAY_START_S + t) % 86400.0
    h, rest = divmod(s, 3600.0)
    m, sec = divmod(rest, 60.0)
    return f"{int(h):02d}:{int(m):02d}:{sec:09.6f}\n"[-TIMESTAMP_TOKENS:]


def generate(phases: Phases, duration_s: float, seed: int = 0, block_size: int = 16,
             keep_tokens: bool = True) -> Iterator[SimRequest]:
    """The request stream of ``phases`` over ``duration_s`` seconds, in time order."""
    return WorkloadGenerator(phases, duration_s, seed, block_size, keep_tokens).requests()
