"""How the console words a check's or a step's state (pure: no Streamlit calls).

The chain (``console.chain``) has three statuses; "not instrumented" there covers two different
situations an engineer must tell apart:

* **not instrumented** — a signal the check needs has no source at all (nothing will ever show
  up until someone wires it);
* **no data in the window** — every signal has a source, but nothing was measured in the window
  (no ingest errors on a healthy exporter, no async-prefill request in the last five minutes,
  a series Prometheus has not scraped yet).

This module draws that line for display; it does not change the chain's verdict.
"""

from __future__ import annotations

from typing import Literal

from console.chain import NO_DATA, CheckState, StepState
from console.ui import fmt
from prefixscope.catalog import SIGNAL_ENABLE
from prefixscope.diagnosis import SETTLE_S, SETTLE_WINDOW_S
from prefixscope.units import format_duration

Shown = Literal["ok", "pending", "firing", "no_data", "not_instrumented"]

SHOWN_TEXT: dict[Shown, str] = {
    "ok": ":green[:material/check_circle: ok]",
    "pending": ":orange[:material/pending: PENDING]",
    "firing": ":red[:material/error: FIRING]",
    "no_data": ":gray[:material/schedule: no data in the window]",
    "not_instrumented": ":gray[:material/help: not instrumented]",
}


_SPAN = "minute" if SETTLE_WINDOW_S == 60 else format_duration(SETTLE_WINDOW_S)
SETTLED_TEXT = (f"settled: within its limit over the last {_SPAN} for "
                f"{format_duration(SETTLE_S)}; its alert clears when its 5-minute window does")


def settled_note(titles: list[str]) -> str:
    """What the headline says of the checks that left it because they settled."""
    return (f"Settled, no longer the headline: {', '.join(titles)} — back within the limit over the last {_SPAN} "
            f"for {format_duration(SETTLE_S)}; the alert clears when "
            "the 5-minute window does.")


def missing_signals(c: CheckState) -> list[str]:
    """The signals without a source (not the "no data" marker)."""
    return [m for m in c.missing if m != NO_DATA]


def check_shown(c: CheckState) -> Shown:
    """A check's status as shown: "not instrumented" only when a signal has no source; past its
    threshold with the alert not fired yet is *pending*, amber, never a green ok."""
    if c.status == "not_instrumented" and not missing_signals(c):
        return "no_data"
    if c.pending:
        return "pending"
    return c.status


def step_shown(step: StepState) -> Shown:
    """A step's status as shown: "not instrumented" only when none of its causes has a source;
    pending when none of its causes fires but one is past its threshold."""
    if step.status == "ok" and any(c.cause and c.pending for c in step.checks):
        return "pending"
    if step.status != "not_instrumented":
        return step.status
    causes = [c for c in step.checks if c.cause]
    if any(check_shown(c) == "no_data" for c in causes):
        return "no_data"
    return "not_instrumented"


def shown_text(status: Shown) -> str:
    return SHOWN_TEXT[status]


def fires_in_text(seconds: float | None) -> str:
    """How soon a pending alert fires if the breach holds."""
    if seconds is None:
        return "alert pending"
    if seconds <= 0:
        return "alert firing at the next evaluation"
    return f"alert fires in {fmt(seconds, 'seconds')}"


def check_line(c: CheckState) -> str:
    """``Title: value (alert when < threshold) — status``, with what is missing when it is."""
    unit = c.check.unit
    shown = check_shown(c)
    limit = f"alert when {c.check.op} {fmt(c.threshold, unit)}" if c.threshold is not None else "limit not reported"
    line = f"**{c.check.title}**: {fmt(c.value, unit)} ({limit})"
    line += f" — {shown_text(shown)}"
    if c.pending:
        line += f" · past its threshold, {fires_in_text(c.fires_in_s)}"
    if c.settled:
        line += f" · {SETTLED_TEXT}"
    if shown == "not_instrumented":
        line += f" · missing signal: {', '.join(missing_signals(c))}"
        line += "".join(f" · to enable {m}: {SIGNAL_ENABLE[m]}" for m in missing_signals(c) if m in SIGNAL_ENABLE)
    return line


def alert_terms(for_s: float | None, severity: str | None) -> str:
    """An alert's severity and ``for`` in force: ``warning, fires after 2 m past its limit``."""
    shown = severity or "severity not reported"
    if for_s is None:
        return shown
    if for_s <= 0:
        return f"{shown}, fires as soon as it is past its limit"
    return f"{shown}, fires after {format_duration(for_s)} past its limit"
