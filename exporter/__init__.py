"""prefixscope exporter: prefix-cache locality metrics for LLM inference clusters."""

__version__ = "0.1.0"
