"""A paged prefix cache keyed by chained block hashes (vLLM's BlockPool, reduced to what matters).

- Only full blocks carry a hash and can be hit; a partial tail block and decode space are
  anonymous blocks that occupy capacity while a request runs.
- Blocks referenced by running requests cannot be evicted; unreferenced resident blocks sit in
  an LRU queue and are evicted oldest first when an allocation needs room. A request's blocks
  are queued tail first on release (as vLLM frees them in reverse), so a chain is evicted from
  its leaf towards its root.
- A request's new blocks become visible to :meth:`match` only on :meth:`commit` (prefill done),
  so requests in flight together cannot reuse each other's blocks.
- Every change a consumer of vLLM's KV events would see is returned as :class:`Stored`,
  :class:`Removed` and :class:`Cleared` values, in order.
- With a :class:`~fleet.residency.ResidencySampler` (vLLM's ``--kv-cache-metrics``), a sample of
  the blocks is followed from allocation to eviction on the caller's clock: the ``at`` of
  :meth:`acquire` (hits, evictions, the allocation of the blocks it will store) and nothing else.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from fleet.residency import ResidencySampler

MEDIUM_GPU = "GPU"


@dataclass(frozen=True, slots=True)
class Stored:
    """Consecutive newly cached blocks; ``token_ids`` has ``len(hashes) * block_size`` ids, or
    is empty when the tokens are unknown (trace replay, where block ids stand in for hashes).
    ``lora_name``/``lora_id`` name the LoRA adapter of the request that computed them (vLLM's
    BlockStored fields; None without one). ``cache_salt``: the request's salt (vLLM lists it in
    the ``extra_keys`` of the prompt's first block only)."""

    hashes: tuple[int, ...]
    parent: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str = MEDIUM_GPU
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True)
class Removed:
    hashes: tuple[int, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared


@dataclass(slots=True)
class _Alloc:
    held: list[int]  # resident hashes this request references, in chain order
    pending: list[int]  # hashes it computes, stored on commit
    parent: int | None  # hash before pending[0]
    tokens: Sequence[int] | None  # the whole prompt's tokens (for BlockStored.token_ids), until commit
    first_new: int  # index of pending[0] in the request's chain
    reserved: int  # capacity reserved for pending blocks
    anon: int  # capacity for the partial tail and decode
    committed: bool = False
    hit_blocks: int = 0
    dropped_blocks: int = 0  # new blocks that found no room and were not cached
    lora_id: int | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    at: float = 0.0  # when it was admitted (its new blocks' allocation, for the residency sample)
    extra: dict = field(default_factory=dict)


class CapacityError(RuntimeError):
    pass


class PagedPrefixCache:
    def __init__(self, num_gpu_blocks: int, block_size: int, residency: ResidencySampler | None = None) -> None:
        if num_gpu_blocks <= 0 or block_size <= 0:
            raise ValueError("num_gpu_blocks and block_size must be positive")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        self.residency = residency  # None: the engine runs without --kv-cache-metrics
        self._refs: dict[int, int] = {}  # resident hash -> reference count
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced resident, oldest first
        self._reserved = 0  # capacity held by pending and anonymous blocks
        self._allocs: dict[str, _Alloc] = {}
        # resident hash -> (LoRA adapter, cache salt) of the request that stored it (ground truth)
        self._labels: dict[int, tuple[str | None, str | None]] = {}

    # -- read-only views ------------------------------------------------------------------
    def match(self, block_hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``block_hashes`` that are resident (no side effects)."""
        refs = self._refs
        n = 0
        for h in block_hashes:
            if h not in refs:
                break
            n += 1
        return n

    @property
    def resident_blocks(self) -> int:
        return len(self._refs)

    @property
    def used_blocks(self) -> int:
        """Blocks held by running requests (referenced, pending or anonymous)."""
        return len(self._refs) - len(self._lru) + self._reserved

    @property
    def usage(self) -> float:
        return min(1.0, self.used_blocks / self.num_gpu_blocks)

    def __contains__(self, h: int) -> bool:
        return h in self._refs

    def resident(self) -> set[int]:
        return set(self._refs)

    def resident_by_label(self) -> dict[tuple[str | None, str | None], int]:
        """Resident blocks per (LoRA adapter, cache salt) of the request that stored them."""
        out: dict[tuple[str | None, str | None], int] = {}
        for h in self._refs:
            key = self._labels.get(h, (None, None))
            out[key] = out.get(key, 0) + 1
        return out

    # -- request lifecycle ----------------------------------------------------------------
    def _make_room(self, n: int, events: list[CacheEvent], at: float) -> int:
        """Evict unreferenced blocks until ``n`` blocks are free; returns how many are free (≤ n)."""
        free = self.num_gpu_blocks - len(self._refs) - self._reserved
        lru, refs, sampler = self._lru, self._refs, self.residency
        while free < n and lru:
            h, _ = lru.popitem(last=False)
            del refs[h]
            self._labels.pop(h, None)
            events.append(Removed((h,)))  # vLLM emits one BlockRemoved per evicted block
            if sampler is not None:
                sampler.evicted(h, at)
            free += 1
        return min(free, n)

    def acquire(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        token_ids: Sequence[int] | None = None,
        extra_blocks: int = 0,
        max_hit_blocks: int | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        at: float = 0.0,
    ) -> tuple[int, list[CacheEvent]]:
        """Admit a request: reference its resident prefix, reserve room for the rest.

        Returns (hit blocks, events). Hit blocks are capped by ``max_hit_blocks`` (vLLM's
        last-token rule); resident blocks beyond the cap are still referenced, not recomputed
        into a second copy. When room runs out the remaining new blocks are not cached.
        ``token_ids`` (the prompt's, optional) are kept until :meth:`commit` publishes the new
        blocks' tokens, and no longer: the cache itself keeps no tokens. ``at``: the admission's
        time on the caller's clock (read only by the residency sample).
        """
        if request_id in self._allocs:
            raise ValueError(f"request {request_id!r} already holds blocks")
        events: list[CacheEvent] = []
        m = self.match(block_hashes)
        held = list(block_hashes[:m])
        sampler = self.residency
        for h in held:
            c = self._refs[h]
            if c == 0:
                del self._lru[h]
            self._refs[h] = c + 1
            if sampler is not None:
                sampler.accessed(h, at)
        want_new = len(block_hashes) - m
        got = self._make_room(want_new + max(0, extra_blocks), events, at)
        new = min(want_new, got)
        anon = min(max(0, extra_blocks), got - new)
        self._reserved += new + anon
        hit = m if max_hit_blocks is None else max(0, min(m, max_hit_blocks))
        self._allocs[request_id] = _Alloc(
            held=held,
            pending=list(block_hashes[m : m + new]),
            parent=block_hashes[m - 1] if m else None,
            tokens=token_ids if want_new else None,
            first_new=m,
            reserved=new,
            anon=anon,
            hit_blocks=hit,
            dropped_blocks=want_new - new,
            lora_id=lora_id,
            lora_name=lora_name,
            cache_salt=cache_salt,
            at=at,
        )
        return hit, events

    def commit(self, request_id: str) -> list[CacheEvent]:
        """Prefill done: the request's new blocks become resident and visible."""
        a = self._allocs.get(request_id)
        if a is None or a.committed:
            return []
        a.committed = True
        events: list[CacheEvent] = []
        bs = self.block_size
        refs, lru, sampler = self._refs, self._lru, self.residency
        run: list[int] = []
        run_parent: int | None = None
        run_start = 0

        def flush() -> None:
            if run:
                toks: tuple[int, ...] = ()
                if a.tokens is not None:
                    toks = tuple(a.tokens[run_start * bs : (run_start + len(run)) * bs])
                events.append(Stored(tuple(run), run_parent, toks, bs, MEDIUM_GPU, a.lora_id, a.lora_name,
                                     a.cache_salt))

        prev = a.parent
        for i, h in enumerate(a.pending):
            if h in refs:
                # Stored meanwhile by a request that ran alongside: share it, free our copy.
                flush()
                run = []
                c = refs[h]
                if c == 0:
                    del lru[h]
                refs[h] = c + 1
            else:
                if not run:
                    run_parent, run_start = prev, a.first_new + i
                refs[h] = 1
                if sampler is not None:
                    sampler.allocated(h, a.at)
                if a.lora_name is not None or a.cache_salt is not None:
                    self._labels[h] = (a.lora_name, a.cache_salt)
                run.append(h)
            prev = h
            a.held.append(h)
        flush()
        self._reserved -= a.reserved
        a.reserved = 0
        a.pending = []
        a.tokens = None  # published: the running request needs only its hashes from here on
        return events

    def release(self, request_id: str) -> list[CacheEvent]:
        """The request finished (or was aborted before commit): drop its references."""
        a = self._allocs.pop(request_id, None)
        if a is None:
            return []
        self._reserved -= a.reserved + a.anon
        for h in reversed(a.held):  # tail first, so leaves are evicted before their parents
            c = self._refs.get(h)
            if c is None:
                continue  # cleared by reset while running
            if c <= 1:
                self._refs[h] = 0
                self._lru[h] = None
            else:
                self._refs[h] = c - 1
        return []

    def store(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        token_ids: Sequence[int] | None = None,
        extra_blocks: int = 0,
        max_hit_blocks: int | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        at: float = 0.0,
    ) -> tuple[int, list[CacheEvent]]:
        """acquire + commit in one step (the request is still referenced until release)."""
        hit, events = self.acquire(request_id, block_hashes, token_ids, extra_blocks, max_hit_blocks,
                                   lora_id, lora_name, cache_salt, at)
        events += self.commit(request_id)
        return hit, events

    def reset(self) -> list[CacheEvent]:
        """Drop every cached block (vLLM's reset_prefix_cache). Running requests keep their room
        as anonymous blocks; pending blocks will not be cached."""
        for a in self._allocs.values():
            kept = sum(1 for h in a.held if h in self._refs) + a.reserved
            a.anon += kept
            self._reserved += kept - a.reserved
            a.reserved = 0
            a.held = []
            a.pending = []
            a.tokens = None
            a.committed = True
        self._refs.clear()
        self._lru.clear()
        self._labels.clear()
        if self.residency is not None:
            self.residency.reset()  # vLLM forgets its samples unobserved
        return [Cleared()]
