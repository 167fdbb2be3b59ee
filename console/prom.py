"""A read-only client for the Prometheus HTTP API (no Streamlit in here)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import requests

from console import promql
from console.http_json import get_json


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float | None  # None for NaN: "no data", never 0


class PrometheusClient:
    """``scope``: the cluster every query is narrowed to (:func:`console.promql.scoped`). Its label
    with no value picks the only value Prometheus has (looked up again every ``SCOPE_TTL_S``);
    with several, the first, and :attr:`scope_note` says so. None: queries as written."""

    source = "Prometheus"
    SCOPE_TTL_S = 60.0

    def __init__(self, base_url: str, timeout: float = 5.0, scope: promql.Scope | None = None) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.session = requests.Session()
        self.configured_scope = scope
        self._scope: promql.Scope | None = scope if scope is None or scope.value is not None else None
        self._scope_at = -math.inf
        self.scope_note: str | None = None

    @property
    def scope(self) -> promql.Scope | None:
        """The scope queries are narrowed to (the configured one, or the one found)."""
        wanted = self.configured_scope
        if wanted is None or wanted.value is not None:
            return wanted
        if time.monotonic() - self._scope_at >= self.SCOPE_TTL_S:
            values = sorted({s.labels.get(wanted.label, "") for s in self._query(promql.scope_values(wanted.label))})
            values = [v for v in values if v]
            self._scope = promql.Scope(wanted.label, values[0] if values else None)
            self.scope_note = (f"Prometheus watches {len(values)} values of {wanted.label} ({', '.join(values)}): "
                               f"showing {values[0]}; choose one with --cluster." if len(values) > 1 else None)
            self._scope_at = time.monotonic()
        return self._scope

    def _get(self, path: str, params: dict | None = None) -> dict:
        return get_json(self.session, self.source, self.base_url, path, params, self.timeout)

    def ready(self) -> bool:
        try:
            return self.session.get(self.base_url.rstrip("/") + "/-/ready", timeout=self.timeout).ok
        except requests.RequestException:
            return False

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
        """An instant query, narrowed to the scope."""
        return self._query(promql.scoped(expr, self.scope), at)

    def _query(self, expr: str, at: float | None = None) -> list[Sample]:
        params: dict = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._get("/api/v1/query", params)
        if data.get("resultType") == "scalar":
            return [Sample({}, _num(data["result"][1]))]
        return [Sample(r.get("metric", {}), _num(r["value"][1])) for r in data.get("result", [])]

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[tuple[dict, list[tuple[float, float | None]]]]:
        # Prometheus rounds each time to the millisecond on its own: sent as raw floats, start can
        # round up while end rounds down, and the range then loses its last point (now).
        end_ms = math.floor(end * 1000)
        start_ms = end_ms - round((end - start) * 1000)
        data = self._get("/api/v1/query_range", {"query": promql.scoped(expr, self.scope),
                                                  "start": f"{start_ms / 1000:.3f}",
                                                  "end": f"{end_ms / 1000:.3f}", "step": step})
        return [(r.get("metric", {}), [(float(t), _num(v)) for t, v in r.get("values", [])])
                for r in data.get("result", [])]

    def alerts(self) -> list[dict]:
        """The alerts of the scope (alerts keep the scope labels)."""
        scope = self.scope
        return [a for a in self._get("/api/v1/alerts").get("alerts", [])
                if scope is None or scope.matches(a.get("labels") or {})]

    def alert_durations(self) -> dict[str, float]:
        """Each loaded alerting rule's ``for`` in seconds (``/api/v1/rules``' ``duration``)."""
        groups = self._get("/api/v1/rules", {"type": "alert"}).get("groups", [])
        return {str(r.get("name")): float(r.get("duration") or 0) for g in groups for r in g.get("rules", [])
                if r.get("type") == "alerting" and isinstance(r.get("duration", 0), int | float)}


def _num(text: str) -> float | None:
    value = float(text)
    return None if math.isnan(value) else value
