"""The HTTP edge: the server, its routes, /metrics rendering, the JSON API and the OTLP receivers.

Everything here reads the core (``exporter.core``) and writes bytes to clients; nothing here
computes a number the core does not hold."""
