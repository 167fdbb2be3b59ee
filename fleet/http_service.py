"""A small HTTP service on a thread of its own: the fleet's control and router-metrics endpoints."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self


class ThreadedHttpService:
    """Binds at construction (port 0: any free one); ``start`` serves on a daemon thread and
    ``stop`` shuts the server down and closes its socket."""

    thread_name = "http-service"

    def _bind(self, host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> None:
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> Self:
        self._thread = threading.Thread(target=self._server.serve_forever, name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(2)
