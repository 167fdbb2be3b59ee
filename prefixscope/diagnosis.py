"""The diagnosis rule, once: check status, step status and the verdict.

The exporter (``/api/v1/groups``) and the console (from the exporter or from Prometheus)
both colour the chain through these functions, so they cannot disagree on the same values.

- A check is ``not_instrumented`` when its value or its limit is unknown (a missing signal,
  no data in the window, a relative threshold without a baseline): never 0, never ok.
  Otherwise it is ``firing`` when the value is on the wrong side of the limit, else ``ok``.
- Only *cause* checks colour a step and name a verdict. The cluster hit rate
  (``prefix_hit_rate_total``) is the symptom that starts the walk; SLO checks measure what
  users feel. Neither says which step is at fault, so neither colours step 1 nor takes it.
- A step is ``firing`` if one of its cause checks fires, ``ok`` if at least one was measured
  and none fires, ``not_instrumented`` if none could be measured.
- The verdict is the first step (0 → 5) with a firing cause check, or none.

Severity (a label in the threshold file, for routing alerts) plays no part: step 5's checks are
``info`` and are still the verdict of a coupled-optimisation fault.
"""

from __future__ import annotations

from collections.abc import Mapping
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


def is_cause(check: Check) -> bool:
    """Whether the check's firing points at its step (the symptom and SLOs do not)."""
    return check.key != SYMPTOM and check.kind != "slo"


def check_status(op: Literal["<", ">"] | str, value: float | None, limit: float | None) -> Status:
    """``op`` is the catalogue's comparison: the check fires when ``value op limit``."""
    if value is None or limit is None:
        return NOT_INSTRUMENTED
    if op not in ("<", ">"):
        raise ValueError(f"unknown comparison {op!r} (expected < or >)")
    return FIRING if (value < limit if op == "<" else value > limit) else OK


def step_status(step: int, statuses: Mapping[str, Status]) -> Status:
    """The status of one step from its cause checks' statuses (check key → status).

    A check absent from ``statuses`` counts as not instrumented.
    """
    got = {statuses.get(c.key, NOT_INSTRUMENTED) for c in CHECKS if c.group == step and is_cause(c)}
    if FIRING in got:
        return FIRING
    if OK in got:
        return OK
    return NOT_INSTRUMENTED


def firing_causes(step: int, statuses: Mapping[str, Status]) -> tuple[str, ...]:
    """Keys of the step's cause checks that fire, in catalogue order."""
    return tuple(c.key for c in CHECKS if c.group == step and is_cause(c) and statuses.get(c.key) == FIRING)


@dataclass(frozen=True)
class Verdict:
    step: Step
    checks: tuple[str, ...]  # the firing cause checks of that step, in catalogue order

    def as_dict(self) -> dict[str, object]:
        """The ``verdict`` object of ``/api/v1/groups``."""
        return {"step": self.step.number, "title": self.step.title, "checks": list(self.checks)}


def verdict(statuses: Mapping[str, Status]) -> Verdict | None:
    """The first step whose own cause checks fire, or None when none does."""
    for step in STEPS:
        causes = firing_causes(step.number, statuses)
        if causes:
            return Verdict(step, causes)
    return None


def step_statuses(statuses: Mapping[str, Status]) -> dict[int, Status]:
    """Every step's status, by step number."""
    return {step.number: step_status(step.number, statuses) for step in STEPS}
