"""Formatting (pure) and the few Streamlit widgets every page shares."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import tzinfo

import pandas as pd
import streamlit as st

from console import charts
from console.chain import Status
from console.http_json import SourceUnavailable
from console.settings import timezone_name
from console.tables import readable, title
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


def zone() -> tzinfo:
    """The configured time zone (``PREFIXSCOPE_CONSOLE_TZ``), else the console host's."""
    return charts.zone(timezone_name())


def table(rows: Iterable[Mapping[str, object]], key: str, columns: Sequence[str] | None = None,
          wide: Sequence[str] = ()) -> None:
    """A table a person reads: titled headers, values in their units, moments relative and in the
    configured zone (:mod:`console.tables`). ``wide`` columns (by field name) get room for text."""
    shown = readable(rows, zone(), time.time(), columns)
    config = {title(name): st.column_config.TextColumn(width="large") for name in wide}
    st.dataframe(pd.DataFrame(shown), hide_index=True, key=key, column_config=config)


def readable_rows(rows: Iterable[Mapping[str, object]]) -> list[dict[str, str]]:
    """Rows already worded, with titled headers (for ``st.table``)."""
    return readable(rows, zone(), time.time())
