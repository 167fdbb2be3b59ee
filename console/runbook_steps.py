"""The first thing to do: the first runbook step whose condition the evidence meets (pure).

Runbooks (``runbooks/<Alert>.md``) have a ``## Mitigation`` section whose steps are a numbered
(or bulleted) list, most urgent first. A step often fits one cause only — "replace hash-mod
routing" is wrong advice behind a router already on consistent hashing — so :data:`RULES` holds,
per alert, a condition for the steps that have one, read from what the console already knows
(:class:`Evidence`: which signals have a source, which checks are past their limits, the
exporter's pool changes and re-keyed sessions, the reuse decomposition, offload tiers). The
console offers the first step whose condition holds (a step without a rule always holds) and says
what it checked: "the last pool change reshuffled 12% of sessions (consistent hashing moves about
1/N), so not step 1". A condition that cannot be checked (its evidence is missing) holds, and says
so: better the runbook's order than silence. A section written as prose gives its first paragraph.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prefixscope.units import format_reading

_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_ITEM = re.compile(r"^\s{0,3}(?:\d+[.)]|[-*+])\s+(.*)$")


def mitigation_steps(markdown: str) -> list[str]:
    """The list items (or the first paragraph) under the first heading that mentions mitigation,
    each with its wrapped lines joined."""
    in_section = False
    steps: list[list[str]] = []
    prose: list[str] = []
    blank = False
    for line in markdown.splitlines():
        heading = _HEADING.match(line)
        if heading:
            if steps or prose:
                break
            in_section = "mitigat" in heading.group(1).lower()
            continue
        if not in_section:
            continue
        item = _ITEM.match(line)
        if item:
            steps.append([item.group(1).strip()])
        elif not line.strip():
            if prose and not steps:
                break
            blank = True
            continue
        elif steps and (not blank or line.startswith((" ", "\t"))):
            steps[-1].append(line.strip())
        elif steps:
            break  # a paragraph after the list
        else:
            prose.append(line.strip())
        blank = False
    if steps:
        return [" ".join(s) for s in steps]
    return [" ".join(prose)] if prose else []


def first_mitigation(markdown: str) -> str | None:
    """The first step (or paragraph) of the mitigation section, whatever the evidence."""
    steps = mitigation_steps(markdown)
    return steps[0] if steps else None


@dataclass(frozen=True)
class PoolChange:
    ts: float
    before: int | None
    after: int | None
    reshuffled_share: float | None


@dataclass(frozen=True)
class Evidence:
    """What the console knows when it chooses a step (each part None/empty when it could not read it)."""

    signals: frozenset[str] = frozenset()  # signals that have a source
    breaching: frozenset[str] = frozenset()  # check keys past their limits (firing or pending)
    pool_changes: tuple[PoolChange, ...] | None = None  # in the window (None: the exporter did not say)
    rekeys: int | None = None  # sessions re-keyed in the window
    available: float | None = None  # reuse decomposition: shares of prompt tokens
    achieved: float | None = None
    hit_target: float | None = None  # the cluster hit-rate limit
    culprit_workers: int = 0  # workers named as culprits of the check
    offload_tiers: bool | None = None  # some worker holds blocks off the GPU
    router_tree_fill: float | None = None  # the fullest router prefix tree against its --max-tree-size


@dataclass(frozen=True)
class Checked:
    """One condition's outcome: whether the step fits, and what was checked, for a person."""

    holds: bool
    said: str


Condition = Callable[[Evidence], Checked]


def _pool_reshuffle(e: Evidence) -> Checked:
    if e.pool_changes is None:
        return Checked(True, "pool changes unknown (the exporter did not say)")
    if not e.pool_changes:
        return Checked(False, "no pool change in the window")
    last = e.pool_changes[-1]
    share, n = last.reshuffled_share, max(last.before or 0, last.after or 0)
    if share is None:
        return Checked(True, f"a pool change ({last.before} → {last.after} workers), its reshuffle not measured")
    # Consistent hashing moves about 1/N of the keys; hash-mod moves most of them.
    ring = 1 / n if n else 0.0
    if share > max(2 * ring, 0.3):
        return Checked(True, f"the last pool change ({last.before} → {last.after} workers) reshuffled "
                             f"{format_reading(share, 'ratio')} of sessions, far more than the 1/N a "
                             "consistent-hash ring moves")
    return Checked(False, f"the last pool change reshuffled {format_reading(share, 'ratio')} of sessions "
                          f"(about 1/{n}: the router already moves only the keys that must move)")


def _rekeys(e: Evidence) -> Checked:
    if e.rekeys is None:
        return Checked(True, "re-keys unknown (the exporter did not say)")
    if e.rekeys:
        return Checked(True, f"{e.rekeys} sessions re-keyed in the window")
    return Checked(False, "no session re-keyed in the window")


def _breaching(key: str, title: str) -> Condition:
    def check(e: Evidence) -> Checked:
        if key in e.breaching:
            return Checked(True, f"{title} is past its limit")
        return Checked(False, f"{title} is within its limit")
    return check


def _one_worker_stands_out(e: Evidence) -> Checked:
    if e.culprit_workers:
        return Checked(True, f"{e.culprit_workers} worker(s) stand out from the others")
    return Checked(False, "no worker stands out from the others")


def _reuse(routing: bool) -> Condition:
    def check(e: Evidence) -> Checked:
        if e.available is None or e.achieved is None or e.hit_target is None:
            return Checked(True, "reuse not decomposed (records with block hashes and cached tokens are absent)")
        low = e.available < e.hit_target
        shares = (f"available {format_reading(e.available, 'ratio')}, achieved "
                  f"{format_reading(e.achieved, 'ratio')}, target {format_reading(e.hit_target, 'ratio')}")
        return Checked(low != routing, shares)
    return check


def _stream_healthy(e: Evidence) -> Checked:
    bad = sorted(e.breaching & {"kv_event_staleness", "kv_event_gaps", "kv_event_blind_share"})
    if bad:
        return Checked(False, f"the KV-event stream is at fault ({', '.join(bad)} past its limit)")
    return Checked(True, "the KV-event streams are within their limits")


def _no_offload(e: Evidence) -> Checked:
    if e.offload_tiers is None:
        return Checked(True, "offload tiers unknown")
    if e.offload_tiers:
        return Checked(False, "an offload tier is already in use")
    return Checked(True, "no worker offloads KV blocks yet")


# A tree past half its bound is worth trimming: walks grow with it, and eviction already cuts live prefixes.
TREE_FILL_LARGE = 0.5


def _router_tree_large(e: Evidence) -> Checked:
    if e.router_tree_fill is None:
        return Checked(True, "the router's tree size unknown (no router reports it: the SGLang gateway ≥ 1.10.1 "
                             "does after its first eviction pass)")
    said = f"the router's largest prefix tree is at {format_reading(e.router_tree_fill, 'ratio')} of its --max-tree-size"
    return Checked(e.router_tree_fill >= TREE_FILL_LARGE, said)


# alert -> step number (1-based, as the runbook numbers them) -> its condition
RULES: Mapping[str, Mapping[int, Condition]] = {
    "PrefixStickyCollisionsHigh": {1: _pool_reshuffle, 2: _rekeys},
    "PrefixSessionHitRateLow": {1: _breaching("sticky_session_collision_rate", "sticky-session collisions"),
                                2: _breaching("prefix_block_count_per_worker", "cache pressure"),
                                3: _rekeys},
    "PrefixSessionHitRateSloBurn": {},
    "PrefixHitRateLow": {1: _breaching("prefix_root_instability", "root instability"),
                         2: _reuse(routing=True), 3: _reuse(routing=False)},
    "PrefixCacheNearCapacity": {1: _one_worker_stands_out},
    "PrefixTelemetryIndexStale": {1: lambda e: Checked(not _stream_healthy(e).holds, _stream_healthy(e).said),
                                  2: _stream_healthy},
    "PrefixRouterTreeWalkSlow": {1: _router_tree_large, 2: _breaching("prefix_tree_depth_p99", "tree depth")},
}


@dataclass(frozen=True)
class Advice:
    number: int  # the step's number in the runbook (1-based)
    text: str
    skipped: tuple[str, ...] = field(default=())  # why earlier steps were passed over
    checked: str | None = None  # why this step fits, when it has a condition

    def reason(self) -> str:
        """``router reshuffle …, so not step 1; 42 sessions re-keyed in the window``."""
        parts = list(self.skipped)
        if self.checked:
            parts.append(self.checked)
        return "; ".join(parts)


def first_fitting(alert: str, markdown: str, evidence: Evidence) -> Advice | None:
    """The first mitigation step whose condition holds (steps without one always hold)."""
    steps = mitigation_steps(markdown)
    rules = RULES.get(alert, {})
    skipped: list[str] = []
    for number, text in enumerate(steps, start=1):
        rule = rules.get(number)
        if rule is None:
            return Advice(number, text, tuple(skipped))
        got = rule(evidence)
        if got.holds:
            return Advice(number, text, tuple(skipped), got.said)
        skipped.append(f"{got.said}, so not step {number}")
    return Advice(1, steps[0], tuple(skipped), "no step's condition holds: the runbook's first") if steps else None


def pool_changes(raw: Sequence[Mapping] | None) -> tuple[PoolChange, ...] | None:
    """``pool_changes`` of the exporter's ``/api/v1/changes`` as values (None stays unknown)."""
    if raw is None:
        return None
    out = []
    for r in raw:
        ts = r.get("ts")
        if not isinstance(ts, int | float):
            continue
        out.append(PoolChange(float(ts), _int(r.get("before")), _int(r.get("after")), _num(r.get("reshuffled_share"))))
    return tuple(sorted(out, key=lambda p: p.ts))


def _int(v: object) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None
