"""prefixscope exporter: prefix-cache locality metrics for LLM inference clusters."""
