"""The diagnosis rule, once: check status, step status and the verdict.

The exporter (``/api/v1/groups``) and the console (from the exporter or from Prometheus)
both colour the chain through these functions, so they cannot disagree on the same values.

- A check is ``not_instrumented`` when its value or its limit is unknown (a missing signal,
  no data in the window, a relative threshold without a baseline): never 0, never ok.
  Otherwise it is ``firing`` when the value is on the wrong side of the limit, else ``ok``.
- Only *cause* checks colour a step and name a verdict. The cluster hit rate
  (``prefix_hit_rate_total``) is the symptom that starts the walk; SLO checks measure what
  users feel. Neither says which step is at fault, so neither colours step 1 nor takes it.
- A check whose severity in the threshold file is ``info`` is *context*: shown with its step
  and alerted as information, never a cause (:func:`context_checks`). The ingest-error rate and
  the tree depth are context by default: a few rejected inputs or a deep tree on a healthy
  cluster must not name a step.
- A step is ``firing`` if one of its cause checks fires, ``ok`` if at least one was measured
  and none fires, ``not_instrumented`` if none could be measured.
- The verdict is the first step (0 → 5) with a firing cause check, or none.

Every function that applies the rule takes ``context``, the keys of the context checks of the
threshold file in use (``context_checks(thresholds.severities)``), so the exporter, the console and the
Alertmanager inhibitions all read severity from the same file.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Literal

from prefixscope.catalog import CHECKS, STEPS, Check, Step

Status = Literal["ok", "firing", "not_instrumented"]
OK: Status = "ok"
FIRING: Status = "firing"
NOT_INSTRUMENTED: Status = "not_instrumented"
STATUSES: tuple[Status, ...] = (OK, FIRING, NOT_INSTRUMENTED)

# The check that starts the walk and is never a cause.
SYMPTOM = "prefix_hit_rate_total"


CONTEXT_SEVERITY = "info"


def context_checks(severities: Mapping[str, str]) -> frozenset[str]:
    """Keys of the checks the threshold file marks ``info`` (``severities``: threshold key →
    severity, ``Thresholds.severities``): context, never a cause."""
    return frozenset(c.key for c in CHECKS if severities.get(c.threshold) == CONTEXT_SEVERITY)


def is_cause(check: Check, context: Collection[str]) -> bool:
    """Whether the check's firing points at its step (the symptom, SLOs and context do not)."""
    return check.key != SYMPTOM and check.kind != "slo" and check.key not in context


def check_status(op: Literal["<", ">"] | str, value: float | None, limit: float | None) -> Status:
    """``op`` is the catalogue's comparison: the check fires when ``value op limit``."""
    if value is None or limit is None:
        return NOT_INSTRUMENTED
    if op not in ("<", ">"):
        raise ValueError(f"unknown comparison {op!r} (expected < or >)")
    return FIRING if (value < limit if op == "<" else value > limit) else OK


def step_status(step: int, statuses: Mapping[str, Status], context: Collection[str]) -> Status:
    """The status of one step from its cause checks' statuses (check key → status).

    A check absent from ``statuses`` counts as not instrumented.
    """
    got = {statuses.get(c.key, NOT_INSTRUMENTED) for c in CHECKS if c.group == step and is_cause(c, context)}
    if FIRING in got:
        return FIRING
    if OK in got:
        return OK
    return NOT_INSTRUMENTED


def firing_causes(step: int, statuses: Mapping[str, Status], context: Collection[str]) -> tuple[str, ...]:
    """Keys of the step's cause checks that fire, in catalogue order."""
    return tuple(c.key for c in CHECKS
                 if c.group == step and is_cause(c, context) and statuses.get(c.key) == FIRING)


@dataclass(frozen=True)
class Verdict:
    step: Step
    checks: tuple[str, ...]  # the firing cause checks of that step, in catalogue order

    def as_dict(self) -> dict[str, object]:
        """The ``verdict`` object of ``/api/v1/groups``."""
        return {"step": self.step.number, "title": self.step.title, "checks": list(self.checks)}


def verdict(statuses: Mapping[str, Status], context: Collection[str]) -> Verdict | None:
    """The first step whose own cause checks fire, or None when none does."""
    for step in STEPS:
        causes = firing_causes(step.number, statuses, context)
        if causes:
            return Verdict(step, causes)
    return None


def step_statuses(statuses: Mapping[str, Status], context: Collection[str]) -> dict[int, Status]:
    """Every step's status, by step number."""
    return {step.number: step_status(step.number, statuses, context) for step in STEPS}


# ---- the headline: firing, pending or clear ------------------------------------------------
# An alert's state as Prometheus keeps it: a check past its limit is *pending* until it has been
# past it for the alert's ``for``, then *firing*; a check within its limit (or unmeasured) is
# *inactive*. The exporter applies this to its own record of when each check began breaching;
# with Prometheus, the console reads the state of each alert as Prometheus reports it.
AlertState = Literal["firing", "pending", "inactive"]
HeadlineState = Literal["firing", "pending", "clear"]


def alert_state(status: Status, breaching_for_s: float | None, for_s: float) -> AlertState:
    """``status`` is the check's instantaneous status; ``breaching_for_s`` how long it has held."""
    if status != FIRING:
        return "inactive"
    if breaching_for_s is None or breaching_for_s < for_s:
        return "pending"
    return "firing"


# ---- settling: a fault that has ended leaves the headline before its window forgets it -------
# Each check's value (and its alert) reads a 5-minute window, which outlives a fault by up to five
# minutes: the previous fault would hold the headline into the next one. So each check is also read
# over the last SETTLE_WINDOW; a check whose short-window value has stayed within its limit for
# SETTLE_S has *settled*: its alert still fires until its window clears (Prometheus's business), but
# it no longer holds the headline, which moves on to what is still wrong. No short-window value
# (nothing measured in the last minute) is not settled: the headline keeps what it cannot rule out.
SETTLE_WINDOW = "1m"
SETTLE_WINDOW_S = 60.0
SETTLE_S = 30.0


@dataclass(frozen=True)
class Headline:
    """What the on-call person reads first: is it firing, about to fire, or clear — and where."""

    state: HeadlineState
    step: Step | None  # None when clear, or when only the symptom is past its limit
    checks: tuple[str, ...]  # the checks behind the state, in catalogue order
    fires_in_s: float | None = None  # pending: the soonest of those checks' alerts fires this much later
    # checks whose alert still fires or is pending on its window but which have settled (see
    # SETTLE_S): left out of the headline, in catalogue order
    settled: tuple[str, ...] = ()

    def as_dict(self) -> dict[str, object]:
        """The ``headline`` object of ``/api/v1/groups``."""
        return {"state": self.state, "step": self.step.number if self.step else None,
                "title": self.step.title if self.step else None, "checks": list(self.checks),
                "fires_in_s": self.fires_in_s, "settled": list(self.settled)}


def headline(alerts: Mapping[str, AlertState], context: Collection[str],
             fires_in_s: Mapping[str, float | None] | None = None, settled: Collection[str] = ()) -> Headline:
    """Firing beats pending beats clear. Within a state the step is the verdict's rule (the first
    step with such a cause check); the symptom alone makes the state without naming a step. A
    ``settled`` check (back within its limit over the short window for SETTLE_S) counts as inactive."""
    soon = fires_in_s or {}
    gone = tuple(c.key for c in CHECKS if c.key in settled and alerts.get(c.key, "inactive") != "inactive"
                 and (c.key == SYMPTOM or is_cause(c, context)))
    alerts = {k: "inactive" if k in gone else s for k, s in alerts.items()}
    for state in ("firing", "pending"):
        found = verdict({k: FIRING if s == state else OK for k, s in alerts.items()}, context)
        keys = found.checks if found is not None else ((SYMPTOM,) if alerts.get(SYMPTOM) == state else ())
        if not keys:
            continue
        waits = [w for k in keys if (w := soon.get(k)) is not None]
        return Headline(state, found.step if found else None, keys,  # type: ignore[arg-type]
                        min(waits) if state == "pending" and waits else None, gone)
    return Headline("clear", None, (), settled=gone)
