"""A read-only client for the Prometheus HTTP API (no Streamlit in here)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import requests

from console.http_json import get_json


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float | None  # None for NaN: "no data", never 0


class PrometheusClient:
    source = "Prometheus"

    def __init__(self, base_url: str, timeout: float = 5.0) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.session = requests.Session()

    def _get(self, path: str, params: dict | None = None) -> dict:
        return get_json(self.session, self.source, self.base_url, path, params, self.timeout)

    def ready(self) -> bool:
        try:
            return self.session.get(self.base_url.rstrip("/") + "/-/ready", timeout=self.timeout).ok
        except requests.RequestException:
            return False

    def query(self, expr: str, at: float | None = None) -> list[Sample]:
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
        data = self._get("/api/v1/query_range", {"query": expr, "start": f"{start_ms / 1000:.3f}",
                                                  "end": f"{end_ms / 1000:.3f}", "step": step})
        return [(r.get("metric", {}), [(float(t), _num(v)) for t, v in r.get("values", [])])
                for r in data.get("result", [])]

    def alerts(self) -> list[dict]:
        return list(self._get("/api/v1/alerts").get("alerts", []))

    def alert_durations(self) -> dict[str, float]:
        """Each loaded alerting rule's ``for`` in seconds (``/api/v1/rules``' ``duration``)."""
        groups = self._get("/api/v1/rules", {"type": "alert"}).get("groups", [])
        return {str(r.get("name")): float(r.get("duration") or 0) for g in groups for r in g.get("rules", [])
                if r.get("type") == "alerting" and isinstance(r.get("duration", 0), int | float)}


def _num(text: str) -> float | None:
    value = float(text)
    return None if math.isnan(value) else value
