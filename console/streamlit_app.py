"""The console's entrypoint: page config, the sources in the sidebar, and the page router."""

import streamlit as st

from console import data

st.set_page_config(page_title="prefixscope console", page_icon=":material/route:", layout="wide")

pages = [
    st.Page("app_pages/diagnosis.py", title="Diagnosis chain", icon=":material/route:", url_path="diagnosis", default=True),
    st.Page("app_pages/prefix_tree.py", title="Prefix tree", icon=":material/account_tree:", url_path="tree"),
    st.Page("app_pages/workers.py", title="Workers & topology", icon=":material/dns:", url_path="workers"),
    st.Page("app_pages/alerts.py", title="Alerts", icon=":material/notifications_active:", url_path="alerts"),
    st.Page("app_pages/runbook.py", title="Runbooks", icon=":material/menu_book:", url_path="runbook"),
]
page = st.navigation(pages)

src = data.sources()
st.sidebar.markdown("**Sources** (read-only)")
st.sidebar.caption(f"Exporter: {src.exporter_url}")
st.sidebar.caption(f"Prometheus: {src.prometheus_url or 'not configured'}")
if st.sidebar.button("Refresh now", key="refresh"):
    st.cache_data.clear()
page.run()
