"""The fallback ladder of seed §5 and the exit condition of each tier.

When anchoring fails the router tries, in order: ``re_sticky`` (a relaxed sticky key finds a
worker that served the same user/thread), ``warm_pool`` (a cold new session goes to a
warm-pool worker), ``model_downgrade`` (a smaller model when the cold prefill would exceed the
TTFT users accept) and ``async_prefill`` (long prompt, short answer: prefill off the hot path).

Each tier has its exit condition, evaluated on a sliding window of its own outcomes:
- re_sticky exits when it stops improving the hit rate (its hit ratio ≤ ``re_sticky_min_hit``);
- warm_pool stays active only while the cluster TTFT p99 is above target;
- model_downgrade exits when its share of traffic passes ``downgrade_max_share`` (the
  simulator's stand-in for "user satisfaction fell below baseline");
- async_prefill exits when its wait p99 passes the user abandonment threshold.
A tier that exited is suspended for ``suspend_s`` and then tried again.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

TIERS = ("re_sticky", "warm_pool", "model_downgrade", "async_prefill")


@dataclass(frozen=True, slots=True)
class LadderConfig:
    window_s: float = 300.0
    suspend_s: float = 60.0
    min_samples: int = 10
    relax_chars: int = 4  # re-sticky ignores this many trailing characters of the key
    re_sticky_min_hit: float = 0.1
    ttft_target_s: float = 2.0
    downgrade_ttft_s: float = 2.0
    downgrade_max_share: float = 0.2
    async_min_prefill_s: float = 0.5  # only prefills at least this long are worth the async path
    async_max_output: int = 64  # ... and only for short answers (classification, extraction)
    async_abandon_s: float = 5.0
    async_slots: int = 4  # async prefills that run at once


def quantile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    v = sorted(values)
    if not v:
        return None
    return v[min(len(v) - 1, max(0, math.ceil(q * len(v)) - 1))]


class _Window:
    def __init__(self, span: float) -> None:
        self.span = span
        self.items: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> None:
        self.items.append((t, value))

    def values(self, now: float) -> list[float]:
        while self.items and self.items[0][0] < now - self.span:
            self.items.popleft()
        return [v for _, v in self.items]


class FallbackLadder:
    def __init__(self, config: LadderConfig = LadderConfig()) -> None:
        self.config = config
        span = config.window_s
        self.counts: dict[str, int] = dict.fromkeys(TIERS, 0)
        self.exits: dict[str, int] = dict.fromkeys(TIERS, 0)
        self._suspended_until: dict[str, float] = dict.fromkeys(TIERS, -math.inf)
        self._used = {t: _Window(span) for t in TIERS}
        self._re_sticky_hit = _Window(span)
        self._ttft = _Window(span)
        self._all = _Window(span)
        self._async_wait = _Window(span)
        self._async_slots: list[float] = []

    def relaxed_key(self, key: str) -> str | None:
        n = self.config.relax_chars
        return key[:-n] if n and len(key) > n else None

    def usable(self, tier: str, now: float) -> bool:
        return now >= self._suspended_until[tier]

    def _exit(self, tier: str, now: float) -> None:
        self._suspended_until[tier] = now + self.config.suspend_s
        self.exits[tier] += 1

    def observe(self, now: float, tier: str | None, *, prompt_tokens: int, cached_tokens: int, ttft_s: float,
                async_wait_s: float | None = None) -> None:
        """One served request; updates the windows and applies the exit conditions."""
        c = self.config
        self._all.add(now, 1.0 if tier == "model_downgrade" else 0.0)
        self._ttft.add(now, ttft_s)
        if tier is None:
            return
        self.counts[tier] += 1
        self._used[tier].add(now, 1.0)
        if tier == "re_sticky":
            self._re_sticky_hit.add(now, cached_tokens / prompt_tokens if prompt_tokens else 0.0)
            hits = self._re_sticky_hit.values(now)
            if len(hits) >= c.min_samples and sum(hits) / len(hits) <= c.re_sticky_min_hit:
                self._exit(tier, now)
        elif tier == "model_downgrade":
            share = self._all.values(now)
            if len(share) >= c.min_samples and sum(share) / len(share) > c.downgrade_max_share:
                self._exit(tier, now)
        elif tier == "async_prefill" and async_wait_s is not None:
            self._async_wait.add(now, async_wait_s)
            waits = self._async_wait.values(now)
            p99 = quantile(waits, 0.99)
            if len(waits) >= c.min_samples and p99 is not None and p99 > c.async_abandon_s:
                self._exit(tier, now)

    def async_start(self, arrival: float, duration_s: float) -> float:
        """When an async prefill that arrives now can start, given the jobs already queued."""
        slots = self._async_slots
        while slots and slots[0] <= arrival:
            heapq.heappop(slots)
        start = arrival if len(slots) < self.config.async_slots else heapq.heappop(slots)
        heapq.heappush(slots, start + duration_s)
        return start

    def active(self, now: float) -> dict[str, bool]:
        """Tier in use: used in the window and its exit condition not met."""
        out = {}
        for tier in TIERS:
            used = bool(self._used[tier].values(now)) and self.usable(tier, now)
            if tier == "warm_pool" and used:
                p99 = quantile(self._ttft.values(now), 0.99)
                used = p99 is not None and p99 > self.config.ttft_target_s
            out[tier] = used
        return out
