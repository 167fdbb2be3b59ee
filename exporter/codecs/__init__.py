"""Bytes in, model values out: KV-event payloads (vLLM, Dynamo, the relay's stream), the
Prometheus text format, engine and router pages, OTLP spans. Pure: no sockets, no threads, no
files; a bad input is counted and worded, never raised past the codec."""
