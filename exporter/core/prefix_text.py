"""Names for prefixes: the first tokens of a branch's first block, as text a person can read.

A hash says nothing at 3 a.m.; "You are a support agent for…" does. The KV events carry each
stored block's ``token_ids``. Only a few are kept (bounded): the blocks of each event that
starts a prefix family (no parent; its first ``ROOT_BLOCKS``) and the first block of each event
continuing a block already kept (one level down the tree, where hot branches live), at most
``max_tokens`` tokens each and ``max_kept`` blocks in all, oldest forgotten first. Turning tokens into text needs the model's
tokenizer, which the workers have: vLLM serves ``POST /detokenize`` (``{"model", "tokens"}`` →
``{"prompt"}``). :class:`Detokenizer` asks one in a background thread (a bounded queue, answers
cached, failures retried after a while), so an API request never waits on a worker; until an
answer is there, or when no worker answers, the API shows the token ids.

Text from prompts may be private: the exporter keeps and serves it only when its config says
``prefix_text: true`` (docs/exporter.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from exporter.model import BlockStored, KvBatch, RouterSnapshot, StateSink, WorkerSnapshot

log = logging.getLogger("prefixscope.prefix_text")

MAX_TOKENS = 32  # tokens kept per block: a block's worth (16 on vLLM) and a little more
MAX_KEPT = 4096  # blocks whose tokens are kept
ROOT_BLOCKS = 64  # blocks of a family's first event kept (its shared prefix and where it forks)
MAX_CACHED = 2048  # detokenized texts kept
MAX_QUEUED = 64  # detokenize requests waiting; more are dropped and asked again later
RETRY_S = 60.0  # a block whose detokenize failed is asked again after this long
MAX_TEXT_CHARS = 120


class PrefixTokens:
    """Block hash → its first tokens, for the blocks that begin prefix families (thread-safe)."""

    def __init__(self, max_kept: int = MAX_KEPT, max_tokens: int = MAX_TOKENS) -> None:
        self.max_kept = max_kept
        self.max_tokens = max_tokens
        self._tokens: OrderedDict[int, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def observe(self, events: Iterable[object]) -> None:
        """Keep each block of an event that starts a family (up to ``ROOT_BLOCKS`` of them: a
        branch may fork inside that first run) and the first block of an event continuing a kept
        block (a branch one level down)."""
        for ev in events:
            if not isinstance(ev, BlockStored) or not ev.hashes or not ev.token_ids:
                continue
            size = ev.block_size
            with self._lock:
                if ev.parent is None:
                    blocks = ev.hashes[:ROOT_BLOCKS]
                elif ev.parent in self._tokens:
                    blocks = ev.hashes[:1]
                else:
                    continue
                for i, block in enumerate(blocks):
                    if block in self._tokens:
                        continue
                    toks = tuple(ev.token_ids[i * size: i * size + min(size, self.max_tokens)])
                    if not toks or not all(type(t) is int for t in toks):
                        break  # not token ids (or fewer than the blocks): nothing to name them by
                    self._tokens[block] = toks
                while len(self._tokens) > self.max_kept:
                    self._tokens.popitem(last=False)

    def get(self, block: int) -> tuple[int, ...] | None:
        with self._lock:
            return self._tokens.get(block)

    def __len__(self) -> int:
        return len(self._tokens)

    def saved(self) -> list[list]:
        """``[[block, [token, ...]], ...]`` oldest first (the state file; bounded by ``max_kept``)."""
        with self._lock:
            return [[b, list(t)] for b, t in self._tokens.items()]

    def restore(self, saved: object) -> int:
        """Put saved tokens back behind what this process kept; returns how many were malformed."""
        bad = 0
        with self._lock:
            mine = list(self._tokens.items())
            self._tokens.clear()
            for row in saved if isinstance(saved, list) else ():
                if (isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], list)
                        and row[1] and all(type(t) is int for t in row[1])):
                    self._tokens[row[0]] = tuple(row[1][: self.max_tokens])
                else:
                    bad += 1
            for block, toks in mine:
                self._tokens.pop(block, None)
                self._tokens[block] = toks
            while len(self._tokens) > self.max_kept:
                self._tokens.popitem(last=False)
        return bad


class TokenTee:
    """A state sink that keeps the prefix tokens of each KV batch, then hands everything on."""

    def __init__(self, sink: StateSink, tokens: PrefixTokens) -> None:
        self.sink = sink
        self.tokens = tokens

    def apply_kv_batch(self, batch: KvBatch, received_at: float) -> None:
        self.tokens.observe(batch.events)
        self.sink.apply_kv_batch(batch, received_at)

    def worker_restarted(self, worker: str) -> None:
        self.sink.worker_restarted(worker)

    def reset_view(self, worker: str) -> None:
        self.sink.reset_view(worker)

    def view_repaired(self, worker: str, reason: str, reliable: bool) -> None:
        self.sink.view_repaired(worker, reason, reliable)

    def observe_worker(self, snapshot: WorkerSnapshot, scraped_at: float) -> None:
        self.sink.observe_worker(snapshot, scraped_at)

    def observe_router(self, snapshot: RouterSnapshot, scraped_at: float) -> None:
        self.sink.observe_router(snapshot, scraped_at)

    def ingest_records(self, records: Sequence, received_at: float) -> None:
        self.sink.ingest_records(records, received_at)


# (worker base URL, model or None, tokens) -> text, or None when the worker cannot say
Detokenize = Callable[[str, str | None, Sequence[int]], str | None]


def http_detokenize(base_url: str, model: str | None, tokens: Sequence[int], timeout: float = 2.0) -> str | None:
    """vLLM's ``POST /detokenize``; None on any failure (no endpoint, an error, an odd answer)."""
    body: dict[str, object] = {"tokens": list(tokens)}
    if model:
        body["model"] = model
    req = urllib.request.Request(base_url.rstrip("/") + "/detokenize", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            answer = json.loads(resp.read(65536))
    except (OSError, ValueError, urllib.error.URLError):
        return None
    prompt = answer.get("prompt") if isinstance(answer, dict) else None
    return prompt if isinstance(prompt, str) else None


@dataclass(frozen=True)
class Ask:
    block: int
    tokens: tuple[int, ...]
    urls: tuple[tuple[str, str | None], ...]  # (worker base URL, model) to try in order


class Detokenizer:
    """Texts of blocks, asked of the workers off the request path and cached (thread-safe)."""

    def __init__(self, detokenize: Detokenize = http_detokenize, clock: Callable[[], float] = time.monotonic,
                 max_cached: int = MAX_CACHED, retry_s: float = RETRY_S) -> None:
        self.detokenize = detokenize
        self.clock = clock
        self.max_cached = max_cached
        self.retry_s = retry_s
        self._texts: OrderedDict[int, str] = OrderedDict()
        self._failed: dict[int, float] = {}
        self._asked: set[int] = set()
        self._queue: queue.Queue[Ask | None] = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def text(self, block: int) -> str | None:
        with self._lock:
            return self._texts.get(block)

    def saved(self) -> list[list]:
        """``[[key, text], ...]`` oldest first: the texts workers gave (the state file; bounded)."""
        with self._lock:
            return [[k, t] for k, t in self._texts.items()]

    def restore(self, saved: object) -> int:
        """Put saved texts back behind what this process learnt; returns how many were malformed."""
        bad = 0
        with self._lock:
            mine = list(self._texts.items())
            self._texts.clear()
            for row in saved if isinstance(saved, list) else ():
                if isinstance(row, list) and len(row) == 2 and type(row[0]) is int and isinstance(row[1], str):
                    self._texts[row[0]] = row[1]
                else:
                    bad += 1
            for key, text in mine:
                self._texts.pop(key, None)
                self._texts[key] = text
            while len(self._texts) > self.max_cached:
                self._texts.popitem(last=False)
        return bad

    def want(self, ask: Ask) -> None:
        """Queue a block unless its text is known, asked, or failed recently (never blocks)."""
        with self._lock:
            failed = self._failed.get(ask.block)
            if ask.block in self._texts or ask.block in self._asked or not ask.urls \
                    or (failed is not None and self.clock() - failed < self.retry_s):
                return
            self._asked.add(ask.block)
        try:
            self._queue.put_nowait(ask)
        except queue.Full:
            with self._lock:
                self._asked.discard(ask.block)

    def work_once(self, ask: Ask) -> None:
        text = None
        for url, model in ask.urls:
            text = self.detokenize(url, model, ask.tokens)
            if text is not None:
                break
        with self._lock:
            self._asked.discard(ask.block)
            if text is None:
                self._failed[ask.block] = self.clock()
                if len(self._failed) > self.max_cached:
                    self._failed.pop(next(iter(self._failed)))
                return
            self._failed.pop(ask.block, None)
            self._texts[ask.block] = text
            while len(self._texts) > self.max_cached:
                self._texts.popitem(last=False)

    def drain(self) -> None:
        """Answer everything queued now (tests, and the thread's loop)."""
        while True:
            try:
                ask = self._queue.get_nowait()
            except queue.Empty:
                return
            if ask is not None:
                self.work_once(ask)

    def _run(self) -> None:
        while (ask := self._queue.get()) is not None:
            try:
                self.work_once(ask)
            except Exception:  # a bug here must not end naming for the life of the process
                log.exception("detokenizing block %x failed", ask.block)

    def start(self) -> Detokenizer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="prefix-text", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            with contextlib.suppress(queue.Full):  # a full queue: the daemon thread ends with the process
                self._queue.put_nowait(None)
            self._thread.join(timeout=2)
            self._thread = None


def short_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """One line: whitespace runs become one space; longer texts end in an ellipsis."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


class PrefixNames:
    """What the API shows of a branch: its text when a worker detokenized it, else its token ids."""

    def __init__(self, tokens: PrefixTokens, detokenizer: Detokenizer, worker_urls: Mapping[str, str]) -> None:
        self.tokens = tokens
        self.detokenizer = detokenizer
        self.worker_urls = dict(worker_urls)  # worker name -> HTTP base URL

    def name(self, block: int, holders: Sequence[str], models: Mapping[str, str | None]) -> dict[str, object]:
        """``{"text": str | None, "token_ids": [...] | None}``; asks for the text when unknown."""
        toks = self.tokens.get(block)
        if toks is None:
            return {"text": None, "token_ids": None}
        text = self.detokenizer.text(block)
        if text is None:
            others = [w for w in self.worker_urls if w not in holders]
            urls = tuple((self.worker_urls[w], models.get(w)) for w in [*holders, *others] if w in self.worker_urls)
            self.detokenizer.want(Ask(block, toks, urls[:3]))
        return {"text": None if text is None else short_text(text), "token_ids": list(toks)}
