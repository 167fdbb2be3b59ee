"""Routing policies as pure functions over the router's view of its healthy workers.

Each policy gets the request's facts and one :class:`Candidate` per healthy worker (in pool
order) and returns ``(worker, decision)``. Nothing here does I/O or keeps time; the router
(``fleet/router.py``) supplies loads, its prefix-index belief and the topology.

- ``random``, ``round-robin``: no affinity at all.
- ``hash-mod``: ``pool[h(key) % N]`` — stable while the pool is, reshuffles about (N−1)/N of
  the keys when a worker joins (seed §3).
- ``consistent-hash``: a ring with virtual nodes; a pool change moves about 1/N of the keys.
- ``prefix-tree``: the longest match in the router's own index, balanced by load.
- ``topology-aware``: seed §4 — GPU class by prompt/output length, then the NVLink domain that
  holds the longest cached prefix, then match and load inside that domain.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b

from fleet.topology import Topology

POLICIES = ("random", "round-robin", "hash-mod", "consistent-hash", "prefix-tree", "topology-aware")
# Policies that route by key alone, without a session table or the prefix index.
STATELESS_POLICIES = frozenset({"random", "round-robin", "hash-mod", "consistent-hash"})


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    load: float  # requests in flight on the worker, as the router counts them
    capacity: int  # max concurrent requests (load / capacity is the utilisation)
    matched_blocks: int  # leading blocks the router believes are cached there
    sessions: int = 0  # sessions the router has placed there (tie-break: spread new sessions)


@dataclass(frozen=True, slots=True)
class PolicyParams:
    # prefix-tree: one in-flight request costs this many matched tokens of preference, so a
    # shared-prefix group stays on one worker until that worker is clearly busier.
    load_cost_tokens: float = 1024.0
    # topology-aware (seed §4): long prompts go to the fastest-prefill class, long generations
    # to the fastest-decode class.
    long_prompt_tokens: int = 8192
    long_output_tokens: int = 2048
    # a worker at or past this utilisation is skipped while others have room
    busy_utilisation: float = 0.9
    # ... and so is one with this many more requests in flight than the least loaded
    # (sglang-router's balance_abs_threshold idea: reuse first, until the imbalance is large)
    balance_abs: int = 8


def stable_hash(key: str) -> int:
    """A process-independent 64-bit hash (Python's ``hash`` is salted per process)."""
    return int.from_bytes(blake2b(key.encode(), digest_size=8).digest(), "big")


def pick_random(cands: Sequence[Candidate], rng: random.Random) -> tuple[str, str]:
    return rng.choice(cands).name, "random"


def pick_round_robin(cands: Sequence[Candidate], counter: int) -> tuple[str, str]:
    return cands[counter % len(cands)].name, "round_robin"


def pick_hash_mod(key: str, cands: Sequence[Candidate]) -> tuple[str, str]:
    return cands[stable_hash(key) % len(cands)].name, "hash"


class HashRing:
    """A consistent-hash ring with ``vnodes`` virtual nodes per worker."""

    def __init__(self, workers: Sequence[str], vnodes: int = 160) -> None:
        if not workers:
            raise ValueError("a hash ring needs at least one worker")
        points = sorted((stable_hash(f"{w}#{i}"), w) for w in workers for i in range(vnodes))
        self.workers = tuple(workers)
        self._keys = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def lookup(self, key: str) -> str:
        i = bisect.bisect(self._keys, stable_hash(key))
        return self._owners[i % len(self._owners)]


def pick_consistent_hash(key: str, ring: HashRing) -> tuple[str, str]:
    return ring.lookup(key), "hash"


def _utilisation(c: Candidate) -> float:
    return c.load / c.capacity if c.capacity > 0 else float("inf")


def _least_loaded(cands: Sequence[Candidate]) -> Candidate:
    return min(cands, key=lambda c: (_utilisation(c), c.sessions))


def _roomy(cands: Sequence[Candidate], params: PolicyParams) -> list[Candidate]:
    """Candidates neither near their concurrency limit nor far busier than the least loaded."""
    floor = min(c.load for c in cands)
    return [c for c in cands if _utilisation(c) < params.busy_utilisation
            and c.load - floor <= params.balance_abs] or [_least_loaded(cands)]


def pick_prefix_tree(cands: Sequence[Candidate], block_size: int, params: PolicyParams = PolicyParams()) -> tuple[str, str]:
    """Longest believed match, minus a load cost; with no match anywhere, the least loaded."""
    best_match = max(c.matched_blocks for c in cands)
    if best_match == 0:
        return _least_loaded(cands).name, "least_loaded"
    roomy = _roomy(cands, params)
    best = max(roomy, key=lambda c: (c.matched_blocks * block_size - params.load_cost_tokens * c.load, -c.load, -c.sessions))
    return best.name, "prefix_hit" if best.matched_blocks else "least_loaded"


def preferred_classes(prompt_tokens: int, output_tokens: int, topology: Topology, names: Sequence[str],
                      params: PolicyParams = PolicyParams()) -> set[str]:
    """Seed §4, first layer: GPU classes suited to the request's prompt and output length."""
    workers = [topology.worker(n) for n in names]
    if prompt_tokens >= params.long_prompt_tokens:
        top = max(w.prefill_tps for w in workers)
        return {w.gpu_class for w in workers if w.prefill_tps == top}
    if output_tokens >= params.long_output_tokens:
        top = max(w.decode_tps for w in workers)
        return {w.gpu_class for w in workers if w.decode_tps == top}
    return {w.gpu_class for w in workers}


def pick_topology_aware(cands: Sequence[Candidate], prompt_tokens: int, output_tokens: int, topology: Topology,
                        params: PolicyParams = PolicyParams()) -> tuple[str, str]:
    """Seed §4: reuse in the prefix's NVLink domain beats class fit; class fit beats balance."""
    best_match = max(c.matched_blocks for c in cands)
    roomy = _roomy(cands, params)
    if best_match > 0:
        domains = {topology.domain_of(c.name) for c in cands if c.matched_blocks == best_match}
        in_domain = [c for c in roomy if topology.domain_of(c.name) in domains]
        if in_domain:
            bs = topology.block_size
            best = max(in_domain, key=lambda c: (c.matched_blocks * bs - params.load_cost_tokens * c.load, -c.load, -c.sessions))
            return best.name, "prefix_hit"
    classes = preferred_classes(prompt_tokens, output_tokens, topology, [c.name for c in cands], params)
    fitting = [c for c in roomy if topology.worker(c.name).gpu_class in classes] or roomy
    return _least_loaded(fitting).name, "least_loaded"
