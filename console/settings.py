"""Where the console's data comes from: environment names and defaults (no Streamlit here)."""

PROMETHEUS_ENV = "PREFIXSCOPE_PROMETHEUS_URL"
EXPORTER_ENV = "PREFIXSCOPE_EXPORTER_URL"
DEFAULT_EXPORTER_URL = "http://127.0.0.1:9400"
