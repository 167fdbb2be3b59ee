"""Runbook: one alert's runbook, rendered in place (chosen from the catalogue's alerts)."""

import streamlit as st

from console.links import in_app_markdown, runbook_markdown
from prefixscope.catalog import CHECKS

st.title("Runbooks")
alerts = sorted({c.alert for c in CHECKS})
asked = st.query_params.get("alert")
# The query parameter only selects among catalogue names; anything else falls back to the first.
choice = st.selectbox("Alert", alerts, index=alerts.index(asked) if asked in alerts else 0, key="runbook_alert")
st.query_params["alert"] = choice
text = runbook_markdown(choice)
if text is None:
    st.info(f"No runbook file for {choice} in this installation.")
else:
    st.markdown(in_app_markdown(text))
