"""The console's entrypoint: page config, the sources in the sidebar, and the page router.

Every page has its own URL (``/diagnosis``, ``/tree``, ``/workers``, ``/tiers``, ``/alerts``, ``/runbook``)
so links and bookmarks open it directly. The root URL shows the diagnosis chain through a hidden
page running the same script: Streamlit serves a page marked ``default`` at ``/`` only, so the
visible diagnosis page cannot be the default without losing ``/diagnosis``.
"""

import time

import streamlit as st

from console import data, ui
from console.settings import GRAFANA_ENV, announce_path, link_settings
from prefixscope.units import format_moment

st.set_page_config(page_title="prefixscope console", page_icon=":material/route:", layout="wide")

DIAGNOSIS = "app_pages/diagnosis.py"
pages = [
    st.Page(DIAGNOSIS, title="Diagnosis chain", icon=":material/route:", url_path="diagnosis"),
    st.Page("app_pages/prefix_tree.py", title="Prefix tree", icon=":material/account_tree:", url_path="tree"),
    st.Page("app_pages/workers.py", title="Workers & topology", icon=":material/dns:", url_path="workers"),
    st.Page("app_pages/tiers.py", title="Cache tiers", icon=":material/layers:", url_path="tiers"),
    st.Page("app_pages/alerts.py", title="Alerts", icon=":material/notifications_active:", url_path="alerts"),
    st.Page("app_pages/runbook.py", title="Runbooks", icon=":material/menu_book:", url_path="runbook"),
    st.Page(DIAGNOSIS, title="Diagnosis chain", icon=":material/route:", url_path="home", default=True,
            visibility="hidden"),
]
page = st.navigation(pages)

src = data.sources()
links = link_settings()
st.sidebar.markdown("**Sources** (read-only)")
st.sidebar.caption(f"Exporter: {src.exporter_url}")
st.sidebar.caption(f"Prometheus: {src.prometheus_url or 'not configured'}")
st.sidebar.caption(f"Grafana: {links.grafana_url or f'not configured ({GRAFANA_ENV})'}")
if st.sidebar.button("Refresh now", key="refresh"):
    st.cache_data.clear()
news_file = announce_path()
if news_file is not None:
    news = data.announcements(str(news_file))
    if news:
        now = time.time()
        st.info(f"**Now running** · {format_moment(news[0].ts, ui.zone(), now)}: {news[0].text}",
                icon=":material/campaign:")
        if len(news) > 1:
            with st.expander("Earlier"):
                for n in news[1:]:
                    st.caption(f"{format_moment(n.ts, ui.zone(), now)}: {n.text}")
page.run()
