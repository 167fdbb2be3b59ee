"""The on-call console: the ordered diagnosis chain and prefix-tree hotspots (Streamlit)."""
