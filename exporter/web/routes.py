"""The HTTP edge's routing, as plain values: requests, responses, errors and a route table.

A handler takes a :class:`Request` and returns a :class:`Response`, or raises :class:`HttpError`
(any other exception is a bug: the server answers 500). :class:`RouteTable` maps method + path to
a handler; an unknown path is 404, a known path with another method 405 with an ``Allow``
header. Nothing here touches a socket, so routing is tested directly.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


class HttpError(Exception):
    """An answer other than success: status, message, extra headers (e.g. ``Allow``)."""

    status = 500

    def __init__(self, message: str, status: int | None = None, headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.headers: dict[str, str] = dict(headers or {})

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class BadRequest(HttpError, ValueError):
    """Raised by an API builder for an invalid query parameter (answered as 400)."""

    status = 400


class Headers(Protocol):
    """What handlers need of request headers (``http.client.HTTPMessage`` and a dict provide it)."""

    def get(self, name: str, /) -> str | None: ...


@dataclass(frozen=True)
class Request:
    method: str  # as sent; HEAD is routed to the GET handler
    path: str  # without the query string and trailing slash ("/" for the root)
    query: Mapping[str, str]  # last value of each parameter
    headers: Headers
    read_body: Callable[[int], bytes] = lambda _n: b""  # reads that many bytes of the body
    client: str = ""  # the peer's address (loopback or not decides what it may do)

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


def finite(value: Any) -> Any:
    """NaN/inf are not JSON: a non-finite value means "no value", so it becomes null (never 0)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_response(status: int, payload: Any, headers: Mapping[str, str] | None = None) -> Response:
    body = json.dumps(finite(payload), default=str, separators=(",", ":"), allow_nan=False).encode()
    return Response(status, body, "application/json", dict(headers or {}))


def error_response(error: HttpError) -> Response:
    """The one shape of every error answer: ``{"status": "error", "error": message}``."""
    return json_response(error.status, {"status": "error", "error": error.message}, error.headers)


class RouteTable:
    """Method + path → handler. HEAD is served by a path's GET handler."""

    def __init__(self) -> None:
        self._routes: dict[str, dict[str, Handler]] = {}  # path -> method -> handler
        self._wrong_method: dict[str, str] = {}  # path -> what a 405 on it says

    def add(self, method: str, path: str, handler: Handler, wrong_method_hint: str | None = None) -> RouteTable:
        self._routes.setdefault(path, {})[method.upper()] = handler
        if wrong_method_hint is not None:
            self._wrong_method[path] = wrong_method_hint
        return self

    def paths(self) -> list[str]:
        return list(self._routes)

    def allowed(self, path: str) -> list[str]:
        return sorted(self._routes.get(path, {}))

    def resolve(self, method: str, path: str) -> Handler:
        """The handler for ``method`` on ``path``; HttpError 404 (no such path) or 405 (other methods)."""
        by_method = self._routes.get(path)
        if by_method is None:
            raise HttpError(f"no such endpoint: {path}", 404)
        handler = by_method.get("GET" if method.upper() == "HEAD" else method.upper())
        if handler is None:
            raise HttpError(self._wrong_method.get(path, "method not allowed"), 405,
                            {"Allow": ", ".join(self.allowed(path))})
        return handler
