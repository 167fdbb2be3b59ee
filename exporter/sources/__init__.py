"""Source adapters: the thin edges that read workers, routers and request records.

``scrape`` (worker and router /metrics over HTTP), ``kv_zmq`` (vLLM KV-cache events over ZMQ,
with replay) and ``records`` (NDJSON request records over HTTP or from a tailed file) turn what
they read into ``exporter.model`` values and hand them to a ``StateSink``; bad input is counted
in ``exporter.core.health.Health`` and never stops the rest.
"""
