"""GET a ``{"status": "ok", "data": ...}`` JSON answer; every failure becomes one clear error.

Prometheus's HTTP API and the exporter's ``/api/v1`` share this envelope, so both clients use
this one function. Callers show :class:`SourceUnavailable` as a message, never a stack trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import requests


class SourceUnavailable(RuntimeError):
    """A data source is down, slow, or answered something that is not its documented JSON."""

    def __init__(self, source: str, url: str, reason: str) -> None:
        super().__init__(f"{source} at {url} is unavailable: {reason}")
        self.source = source
        self.url = url
        self.reason = reason


def get_json(session: requests.Session, source: str, base_url: str, path: str,
             params: Mapping[str, Any] | None = None, timeout: float = 5.0) -> Any:
    """GET ``base_url + path`` and return the envelope's ``data``."""
    url = base_url.rstrip("/") + path
    try:
        resp = session.get(url, params=params, timeout=timeout)
    except requests.RequestException as exc:
        raise SourceUnavailable(source, base_url, _short(exc)) from None
    try:
        body = resp.json()
    except ValueError:
        raise SourceUnavailable(source, base_url, f"HTTP {resp.status_code}, not JSON") from None
    # Prometheus says "success", the exporter says "ok"; both carry "data".
    if not isinstance(body, dict) or body.get("status") not in ("success", "ok"):
        error = body.get("error") if isinstance(body, dict) else None
        raise SourceUnavailable(source, base_url, f"HTTP {resp.status_code}: {error or 'unexpected answer'}")
    return body.get("data")


def _short(exc: Exception) -> str:
    """The gist of a requests error (its repr nests urllib3 objects nobody needs at 3 a.m.)."""
    if isinstance(exc, requests.ConnectionError):
        return "connection refused or host unreachable"
    if isinstance(exc, requests.Timeout):
        return "timed out"
    return type(exc).__name__
