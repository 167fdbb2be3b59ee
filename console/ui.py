"""Formatting (pure) and the few Streamlit widgets every page shares."""

from __future__ import annotations

import streamlit as st

from console.chain import NO_DATA, CheckState, Status
from console.http_json import SourceUnavailable
from prefixscope.units import format_reading

# Streamlit's bundled Material icons and colour directives: no emoji font needed on the viewer.
STATUS_TEXT: dict[str, str] = {
    "ok": ":green[:material/check_circle: ok]",
    "firing": ":red[:material/error: FIRING]",
    "not_instrumented": ":gray[:material/help: not instrumented]",
}


def fmt(value: float | None, unit: str) -> str:
    """A number in its unit; a missing value is "—" (missing), never 0."""
    return format_reading(value, unit)


def status_text(status: Status) -> str:
    return STATUS_TEXT[status]


def check_line(c: CheckState) -> str:
    """``Title: value (alert when < threshold) — status``, with what is missing when it is."""
    unit = c.check.unit
    line = f"**{c.check.title}**: {fmt(c.value, unit)} (alert when {c.check.op} {fmt(c.threshold, unit)})"
    line += f" — {status_text(c.status)}"
    if c.pending:
        line += " · over threshold, alert pending"
    if c.status == "not_instrumented":
        gone = [m for m in c.missing if m != NO_DATA]
        line += f" · missing signal: {', '.join(gone)}" if gone else " · no data yet"
    return line


def source_down(exc: SourceUnavailable) -> None:
    st.error(f"**{exc.source} is down or unreachable** ({exc.url}): {exc.reason}. "
             "Check that it runs and that the console points at it.", icon=":material/cloud_off:")


def banners(notes: list[str]) -> None:
    for note in notes:
        st.warning(note, icon=":material/warning:")
