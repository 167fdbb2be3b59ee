"""Formatting (pure) and the few Streamlit widgets every page shares."""

from __future__ import annotations

import streamlit as st

from console.chain import Status
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


def source_down(exc: SourceUnavailable) -> None:
    st.error(f"**{exc.source} is down or unreachable** ({exc.url}): {exc.reason}. "
             "Check that it runs and that the console points at it.", icon=":material/cloud_off:")


def banners(notes: list[str]) -> None:
    for note in notes:
        st.warning(note, icon=":material/warning:")
