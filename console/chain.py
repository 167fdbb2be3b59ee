"""The ordered diagnosis chain (steps 0–5) as plain values, from Prometheus or the exporter.

Pure: callers pass query results in, nothing here does I/O. Each check's limit, ``for`` and
severity are the ones in force (:mod:`console.limits`: the exporter's, whatever values are read from). How statuses make a step's colour
and the verdict is prefixscope.diagnosis, the rule the exporter's /api/v1/groups uses too: the
verdict is the first step whose own *cause* checks fire; the cluster hit rate is the symptom
that starts the walk and SLO checks measure what users feel, so neither colours or names a step.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Literal

from console.culprits import Culprits, parse_culprits
from console.limits import Limit, Limits, limits_from_groups
from prefixscope import diagnosis
from prefixscope.catalog import CHECKS, STEPS, Check
from prefixscope.diagnosis import STATUSES, AlertState, Headline, Status, is_cause
from prefixscope.units import parse_timestamp

SYMPTOM_KEY = diagnosis.SYMPTOM
NO_DATA = "no data"
# The check that counts the exporter's family shards Prometheus no longer scrapes.
SHARDS_KEY = "exporter_shards"


@dataclass(frozen=True)
class CheckState:
    check: Check
    value: float | None  # the check's value expression; a ratio to the baseline when it has one
    threshold: float | None  # the limit in force; None when the exporter did not say
    status: Status
    missing: tuple[str, ...] = ()  # missing signals, or NO_DATA
    pending: bool = False  # over its threshold but the alert's `for` has not elapsed
    fires_in_s: float | None = None  # pending: how long until the alert fires if the breach holds
    culprits: Culprits | None = None  # who drives the number (the exporter's culprits)
    context: bool = False  # marked ``info`` in the threshold file: shown, never a cause
    for_s: float | None = None  # how long a breach must hold before the alert fires
    severity: str | None = None  # the alert's severity (critical, warning, info)
    # breaching on its window, yet back within its limit over the last minute for the settle time
    # (prefixscope.diagnosis.SETTLE_S): the fault has ended, so it no longer holds the headline
    settled: bool = False

    @property
    def alert_state(self) -> AlertState:
        return "firing" if self.status == "firing" else "pending" if self.pending else "inactive"

    @property
    def breaches(self) -> bool:
        return diagnosis.check_status(self.check.op, self.value, self.threshold) == diagnosis.FIRING

    @property
    def cause(self) -> bool:
        return is_cause(self.check, (self.check.key,) if self.context else ())


@dataclass(frozen=True)
class StepState:
    number: int
    title: str
    question: str
    status: Status
    checks: tuple[CheckState, ...]

    @property
    def firing_causes(self) -> list[CheckState]:
        return [c for c in self.checks if c.cause and c.status == "firing"]


@dataclass(frozen=True)
class Reuse:
    """Shares of prompt tokens: reusable at best, believed cached by the router, achieved."""

    available: float | None
    predicted: float | None
    achieved: float | None
    staleness: float | None = None  # predicted − achieved, floored per request
    # what the router says of itself: its predicted share of the prompt (median over its picks) and
    # its regret (share of its picks below the best eligible overlap); None where it exports neither
    router_predicted: float | None = None
    router_regret: float | None = None

    @property
    def routing_regret(self) -> float | None:
        if self.available is None or self.achieved is None:
            return None
        return max(self.available - self.achieved, 0.0)

    @property
    def index_staleness(self) -> float | None:
        if self.staleness is not None:
            return self.staleness
        if self.predicted is None or self.achieved is None:
            return None
        return max(self.predicted - self.achieved, 0.0)


@dataclass(frozen=True)
class Chain:
    source: Literal["prometheus", "exporter"]
    steps: tuple[StepState, ...]
    symptom: CheckState | None
    reuse: Reuse
    context: frozenset[str] = frozenset()  # context_checks() of the threshold file in use
    limits: Limits | None = None  # the limits in force, and where they were read
    # (index, count) when the exporter read is one of several family shards: its answer is its part
    shard: tuple[int, int] | None = None
    # the missing family shards' indices as Prometheus labels them (the alert's ``shard`` label);
    # empty when none is missing or when they are missing unnamed (never seen since Prometheus started)
    missing_shards: tuple[str, ...] = ()

    @property
    def shards_missing(self) -> int:
        """How many of the exporter's family shards Prometheus does not scrape (0: all, or unknown)."""
        c = self.checks().get(SHARDS_KEY)
        counted = int(c.value) if c is not None and c.value is not None and c.value > 0 else 0
        return max(counted, len(self.missing_shards))

    @property
    def partial(self) -> str | None:
        """What the headline says when the cluster answer is partial (a family shard is missing)."""
        n = self.shards_missing
        if not n:
            return None
        which = (" (" + ", ".join(f'shard="{s}"' for s in self.missing_shards) + ")") if self.missing_shards else ""
        return (f"**PARTIAL** · {n} of the exporter's family shards {'is' if n == 1 else 'are'} not scraped{which}: "
                "the cluster's answer lacks their prefix families and home workers, so the numbers pooled over "
                "the shards are withheld and the checks that read them show no data until "
                f"{'it is' if n == 1 else 'they are'} back.")

    @property
    def verdict(self) -> StepState | None:
        """The step the diagnosis rule names from the checks past their limits now — fired or still
        pending — the same instantaneous reading the exporter's own verdict is; the headline says
        whether its alerts have fired yet."""
        found = diagnosis.verdict({c.check.key: diagnosis.FIRING if c.pending else c.status
                                   for s in self.steps for c in s.checks}, self.context)
        return next((s for s in self.steps if s.number == found.step.number), None) if found else None

    def checks(self) -> dict[str, CheckState]:
        return {c.check.key: c for s in self.steps for c in s.checks}

    @property
    def headline(self) -> Headline:
        """Firing, pending or clear, by the rule the exporter's ``headline`` uses too."""
        states = self.checks()
        return diagnosis.headline({k: c.alert_state for k, c in states.items()}, self.context,
                                  {k: c.fires_in_s for k, c in states.items()},
                                  {k for k, c in states.items() if c.settled})

    def with_culprits(self, culprits: Mapping[str, Culprits]) -> Chain:
        """The same chain with culprits attached to the checks that have them."""
        def attach(c: CheckState) -> CheckState:
            got = culprits.get(c.check.key)
            return c if got is None else replace(c, culprits=got)
        steps = tuple(replace(s, checks=tuple(attach(c) for c in s.checks)) for s in self.steps)
        symptom = attach(self.symptom) if self.symptom is not None else None
        return replace(self, steps=steps, symptom=symptom)


def _chain(source: Literal["prometheus", "exporter"], states: Mapping[str, CheckState], reuse: Reuse,
           limits: Limits) -> Chain:
    context = limits.context
    marked = {k: _with_limit(c, limits.of(k), k in context) for k, c in states.items()}
    return Chain(source, _steps(marked, context), marked.get(SYMPTOM_KEY), reuse, context, limits)


def _with_limit(c: CheckState, limit: Limit, context: bool) -> CheckState:
    """The check with its ``for`` and severity as in force (a ``for`` Prometheus reported wins)."""
    return replace(c, context=context, severity=limit.severity,
                   for_s=c.for_s if c.for_s is not None else limit.for_s)


def _steps(states: Mapping[str, CheckState], context: frozenset[str]) -> tuple[StepState, ...]:
    statuses = {key: s.status for key, s in states.items()}
    out = []
    for step in STEPS:
        checks = tuple(states[c.key] for c in CHECKS if c.group == step.number and c.key in states)
        out.append(StepState(step.number, step.title, step.question,
                             diagnosis.step_status(step.number, statuses, context), checks))
    return tuple(out)


def chain_from_prometheus(values: Mapping[str, float | None], baselines: Mapping[str, float | None],
                          signals: Mapping[str, bool], alerts: Iterable[Mapping],
                          limits: Limits, reuse: Reuse, for_s: Mapping[str, float] | None = None,
                          now: float | None = None, settled: Collection[str] = ()) -> Chain:
    """Statuses from recording-rule values, ``signal_available`` and Prometheus's alerts.

    ``signals`` holds the ``prefixscope_signal_available`` series; a signal absent from it is
    missing (no source said it was there). ``alerts`` is ``/api/v1/alerts``' list. ``for_s`` is
    each alert's ``for`` as Prometheus loaded it (alert name → seconds); with ``now``, a pending
    alert's ``activeAt`` says how long until it fires. ``settled``: the checks whose value over the
    last minute stayed within the limit for the settle time (:func:`settled_from_extremes`).
    ``limits`` are the limits in force (the
    exporter's, :func:`console.limits.limits_from_groups`): Prometheus's values are judged against
    the same numbers its rules were generated from.
    """
    alerts = list(alerts)
    state_of = {str(a.get("labels", {}).get("alertname")): str(a.get("state")) for a in alerts
                if a.get("state") == "firing"}
    for a in alerts:
        state_of.setdefault(str(a.get("labels", {}).get("alertname")), str(a.get("state")))
    active_at: dict[str, float] = {}
    for a in alerts:
        name, started = str(a.get("labels", {}).get("alertname")), parse_timestamp(a.get("activeAt"))
        if a.get("state") == "pending" and started is not None:
            active_at[name] = min(started, active_at.get(name, started))
    states: dict[str, CheckState] = {}
    for check in CHECKS:
        value = values.get(check.key)
        if check.baseline is not None and value is not None:
            base = baselines.get(check.key)
            value = value / base if base else None
        missing = tuple(s for s in check.signals if not signals.get(s, False))
        threshold = limits.threshold(check.key)
        alert_state = state_of.get(check.alert)
        status: Status
        if missing:
            status = "not_instrumented"
        elif alert_state == "firing":
            status = "firing"
        elif value is None:
            status, missing = "not_instrumented", (NO_DATA,)
        else:
            status = "ok"
        state = CheckState(check, value, threshold, status, missing)
        pending = status == "ok" and (alert_state == "pending" or state.breaches)
        fires_in = None
        started, wait = active_at.get(check.alert), (for_s or {}).get(check.alert, limits.of(check.key).for_s)
        if pending and started is not None and wait is not None and now is not None:
            fires_in = max(0.0, started + wait - now)
        states[check.key] = CheckState(check, value, threshold, status, missing, pending, fires_in,
                                       for_s=wait, settled=check.key in settled and (status == "firing" or pending))
    return _chain("prometheus", states, reuse, limits)


def chain_from_exporter(groups: Mapping, where: str = "the exporter") -> Chain:
    """The chain from the exporter's ``/api/v1/groups`` (its own windows and its own limits)."""
    limits = limits_from_groups(groups, where)
    by_key = {c.key: c for c in CHECKS}
    states: dict[str, CheckState] = {}
    for step in groups.get("steps", []):
        for raw in step.get("checks", []):
            check = by_key.get(str(raw.get("key")))
            if check is None:
                continue  # a check this console does not know: newer exporter; skip, not crash
            value = _float(raw.get("value"))
            base = _float(raw.get("baseline"))
            if check.baseline is not None and value is not None:
                value = value / base if base else None
            status = raw.get("status")
            if status not in STATUSES:
                status = diagnosis.NOT_INSTRUMENTED
            # The exporter's status is instantaneous; its breach record says whether the alert
            # would have fired yet (an older exporter without one: firing as it says).
            pending = status == diagnosis.FIRING and raw.get("alert_state") == "pending"
            if pending:
                status = diagnosis.OK
            missing = tuple(str(s) for s in raw.get("missing_signals") or ())
            if status == "not_instrumented" and not missing:
                missing = (NO_DATA,)
            states[check.key] = CheckState(
                check, value, limits.threshold(check.key), status, missing, pending,
                _float(raw.get("fires_in_s")) if pending else None, parse_culprits(raw.get("culprits")),
                settled=raw.get("settled") is True and (status == diagnosis.FIRING or pending))
    r = groups.get("reuse") or {}
    prompt = _float(r.get("prompt_tokens"))

    def share(key: str) -> float | None:
        v = _float(r.get(key))
        return v / prompt if v is not None and prompt else None

    selections, routed = _float(r.get("router_regret_selections")), _float(r.get("router_routed_requests"))
    reuse = Reuse(share("available_tokens"), share("predicted_tokens"), share("achieved_tokens"),
                  share("index_staleness_tokens"), _float(r.get("router_predicted_hit_ratio_p50")),
                  selections / routed if selections is not None and routed else None)
    return replace(_chain("exporter", states, reuse, limits), shard=_shard(groups.get("shard")))


def settled_from_extremes(extremes: Mapping[str, float | None], limits: Limits) -> frozenset[str]:
    """The checks whose worst short-window value over the settle time (``promql.settle_extreme``)
    is within the limit in force: settled. No value (nothing measured in the last minute) is not."""
    by_key = {c.key: c for c in CHECKS}
    return frozenset(k for k, v in extremes.items() if k in by_key
                     and diagnosis.check_status(by_key[k].op, v, limits.threshold(k)) == diagnosis.OK)


def _shard(raw: object) -> tuple[int, int] | None:
    """``shard`` of an exporter answer: (index, count), or None for a whole (unsharded) exporter."""
    if not isinstance(raw, Mapping):
        return None
    index, count = raw.get("index"), raw.get("count")
    if type(index) is not int or type(count) is not int or count <= 1 or not 0 <= index < count:
        return None
    return index, count


def shard_note(shard: tuple[int, int] | None) -> str | None:
    """What an on-call reader must know when the exporter read is one shard of several."""
    if shard is None:
        return None
    return (f"This exporter is shard {shard[0] + 1} of {shard[1]}: its statuses, workers, tree and hotspots "
            "are its part of the cluster (the prefix families it owns). The cluster's chain is the "
            "Prometheus that scrapes every shard: set --prometheus-url.")


def reuse_reading(reuse: Reuse, limits: Limits) -> str:
    """Workload, routing or stale index: which one explains the missing reuse."""
    target = limits.threshold("prefix_hit_rate_total")
    stale_limit = limits.threshold("index_staleness")
    if reuse.available is None or reuse.achieved is None:
        return "Not instrumented: records need block_hashes and cached_tokens to decompose reuse."
    if target is None or stale_limit is None:
        return "The exporter did not report the hit-rate and index-staleness limits to judge reuse against."
    if reuse.available < target:
        return (f"Workload: even the best worker held only {reuse.available:.0%} of prompt tokens "
                f"(target {target:.0%}); no routing could do better.")
    staleness = reuse.index_staleness
    if staleness is not None and staleness > stale_limit:
        return (f"Stale index: the router believed {reuse.predicted:.0%} cached, the engines "
                f"reported {reuse.achieved:.0%} (staleness {staleness:.0%} > {stale_limit:.0%}).")
    if reuse.achieved < target:
        return (f"Routing: {reuse.available:.0%} was reusable somewhere but only {reuse.achieved:.0%} "
                f"was achieved (regret {reuse.routing_regret:.0%}).")
    return f"Reuse is healthy: {reuse.achieved:.0%} achieved of {reuse.available:.0%} available."


def _float(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)
