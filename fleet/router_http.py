"""The reference router's HTTP face: ``GET /metrics`` in its flavour's names (fleet.router_metrics).

A thin server beside the workers' and the control endpoint: the page comes from a callable
(the running simulation's router renders it), so the server outlives the scenarios a fleet runs
one after another. Scrape it as a router (``routers:`` in the exporter config, ``kind: auto``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from fleet.http_service import ThreadedHttpService

log = logging.getLogger("prefixscope.fleet.router_http")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class RouterMetricsServer(ThreadedHttpService):
    """``start`` binds and serves, ``stop`` ends; ``metrics_url`` is what an exporter scrapes."""

    thread_name = "router-metrics"

    def __init__(self, page: Callable[[], str], host: str = "127.0.0.1", port: int = 0) -> None:
        self.page = page
        self._bind(host, port, _handler(self))

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"

    def __enter__(self) -> RouterMetricsServer:
        return self.start()

    def __exit__(self, *_exc: object) -> None:
        self.stop()


def _handler(server: RouterMetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("router %s", format % args)

        def _reply(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.split("?", 1)[0].rstrip("/") != "/metrics":
                self._reply(404, b"GET /metrics\n", "text/plain; charset=utf-8")
                return
            try:
                body = server.page().encode()
            except Exception:  # a page that cannot be rendered is a 500, not a dead server
                log.exception("router /metrics failed")
                self._reply(500, b"internal error\n", "text/plain; charset=utf-8")
                return
            self._reply(200, body, CONTENT_TYPE)

    return Handler
