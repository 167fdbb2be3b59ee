"""A read-only client for the exporter's JSON API (docs/api.md); no Streamlit in here."""

from __future__ import annotations

import requests

from console.http_json import SourceUnavailable, _short, get_json


class ExporterClient:
    source = "prefixscope exporter"

    def __init__(self, base_url: str, timeout: float = 5.0) -> None:
        self.base_url = base_url
        self.timeout = timeout
        self.session = requests.Session()

    def _get(self, path: str, params: dict | None = None):
        return get_json(self.session, self.source, self.base_url, path, params, self.timeout)

    def groups(self) -> dict:
        return self._get("/api/v1/groups")

    def culprits(self, keys: tuple[str, ...]) -> dict:
        """``/api/v1/culprits`` for the given check keys (catalogue keys only)."""
        return self._get("/api/v1/culprits", {"checks": ",".join(keys)})

    def tree(self, depth: int = 4, by: str = "hits", limit: int = 200) -> dict:
        if by not in ("hits", "blocks"):
            raise ValueError(f"by must be hits or blocks, not {by!r}")
        return self._get("/api/v1/tree", {"depth": int(depth), "by": by, "limit": int(limit)})

    def hotspots(self, k: int = 10) -> dict:
        return self._get("/api/v1/hotspots", {"k": int(k)})

    def workers(self) -> dict:
        """``/api/v1/workers``: one row per worker with its liveness, cache, hits and KV stream."""
        return self._get("/api/v1/workers")

    def changes(self, from_ts: float | None = None, to_ts: float | None = None) -> dict:
        params = {}
        if from_ts is not None:
            params["from"] = float(from_ts)
        if to_ts is not None:
            params["to"] = float(to_ts)
        return self._get("/api/v1/changes", params)

    def metrics_text(self) -> str:
        """The exporter's ``/metrics`` in the Prometheus text format (read for worker liveness)."""
        url = self.base_url.rstrip("/") + "/metrics"
        try:
            resp = self.session.get(url, timeout=self.timeout, headers={"Accept": "text/plain"})
        except requests.RequestException as exc:
            raise SourceUnavailable(self.source, self.base_url, _short(exc)) from None
        if not resp.ok:
            raise SourceUnavailable(self.source, self.base_url, f"HTTP {resp.status_code} on /metrics")
        return resp.text
