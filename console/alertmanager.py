"""Alertmanager's view of the alerts: which page, and which the chain's inhibition holds back.

``GET /api/v2/alerts`` lists every alert Alertmanager holds with ``status.state`` (``active``:
it notifies; ``suppressed``: inhibited or silenced; ``unprocessed``: just arrived) and the
fingerprints of the alerts inhibiting it and the silences silencing it. :func:`parse_alerts`
turns that answer into :class:`PageAlert` rows (pure, tested on payloads); :func:`fetch_alerts`
is the thin HTTP edge. The v2 API answers a bare JSON list, not Prometheus's envelope, so it
has its own GET here; failures become :class:`~console.http_json.SourceUnavailable`, as for the
other sources.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests

from console.http_json import SourceUnavailable, _short

SOURCE = "Alertmanager"
STATES = ("active", "suppressed", "unprocessed")


@dataclass(frozen=True)
class PageAlert:
    name: str
    labels: Mapping[str, str]
    state: str  # active | suppressed | unprocessed
    inhibited_by: tuple[str, ...]  # fingerprints of the alerts that inhibit this one
    silenced_by: tuple[str, ...]  # ids of the silences that silence it
    fingerprint: str
    starts_at: str
    summary: str

    @property
    def step(self) -> int | None:
        value = self.labels.get("step", "")
        return int(value) if value.isdigit() else None

    @property
    def inhibited(self) -> bool:
        return bool(self.inhibited_by)

    @property
    def silenced(self) -> bool:
        return bool(self.silenced_by)


class BadAnswer(ValueError):
    """The answer is not the documented ``/api/v2/alerts`` shape."""


def _strings(value: Any, what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise BadAnswer(f"{what}: expected a list of strings")
    return tuple(value)


def parse_alerts(payload: Any) -> list[PageAlert]:
    """``/api/v2/alerts`` JSON → rows, ordered by step then name (unknown steps last)."""
    if not isinstance(payload, list):
        raise BadAnswer("expected a JSON list of alerts")
    out = []
    for i, a in enumerate(payload):
        if not isinstance(a, dict) or not isinstance(a.get("labels"), dict) or not isinstance(a.get("status"), dict):
            raise BadAnswer(f"alert {i}: expected an object with labels and status")
        labels = {str(k): str(v) for k, v in a["labels"].items()}
        status = a["status"]
        state = status.get("state")
        if state not in STATES:
            raise BadAnswer(f"alert {i}: unknown state {state!r}")
        annotations = a.get("annotations") if isinstance(a.get("annotations"), dict) else {}
        out.append(PageAlert(
            name=labels.get("alertname", ""), labels=labels, state=state,
            inhibited_by=_strings(status.get("inhibitedBy"), f"alert {i}: status.inhibitedBy"),
            silenced_by=_strings(status.get("silencedBy"), f"alert {i}: status.silencedBy"),
            fingerprint=str(a.get("fingerprint", "")), starts_at=str(a.get("startsAt", "")),
            summary=str(annotations.get("summary", "")),
        ))
    return sorted(out, key=lambda p: (p.step is None, p.step or 0, p.name, p.fingerprint))


def fetch_alerts(base_url: str, session: requests.Session | None = None, timeout: float = 5.0,
                 matchers: Sequence[str] = ()) -> list[PageAlert]:
    """Every alert Alertmanager at ``base_url`` holds (active, inhibited and silenced ones).

    ``matchers`` are Alertmanager filter matchers (``alertname=~"Prefix.*"``)."""
    url = base_url.rstrip("/") + "/api/v2/alerts"
    params: dict[str, Any] = {"active": "true", "inhibited": "true", "silenced": "true", "unprocessed": "true"}
    if matchers:
        params["filter"] = list(matchers)
    http = session or requests.Session()
    try:
        resp = http.get(url, params=params, timeout=timeout)
    except requests.RequestException as exc:
        raise SourceUnavailable(SOURCE, base_url, _short(exc)) from None
    if resp.status_code != 200:
        raise SourceUnavailable(SOURCE, base_url, f"HTTP {resp.status_code}: {resp.text[:200].strip()}")
    try:
        return parse_alerts(resp.json())
    except ValueError as exc:  # not JSON, or not the documented shape (BadAnswer is a ValueError)
        raise SourceUnavailable(SOURCE, base_url, f"unexpected answer: {exc}") from None


def pages(alerts: Sequence[PageAlert]) -> list[PageAlert]:
    """The alerts that notify: active ones (what an incident pages with)."""
    return [a for a in alerts if a.state == "active"]


def shown_state(alert: PageAlert, by_fingerprint: Mapping[str, PageAlert]) -> str:
    """``paging``, ``inhibited by <Alert> (step n)``, ``silenced`` or ``just arrived``, for a person."""
    if alert.inhibited:
        names = []
        for fp in alert.inhibited_by:
            src = by_fingerprint.get(fp)
            if src is None:
                names.append(f"an alert no longer held ({fp})")
            else:
                names.append(src.name + (f" (step {src.step})" if src.step is not None else ""))
        return "inhibited by " + ", ".join(names)
    if alert.silenced:
        return f"silenced ({', '.join(alert.silenced_by)})"
    return {"active": "paging", "unprocessed": "just arrived"}.get(alert.state, alert.state)


def table_rows(alerts: Sequence[PageAlert]) -> list[dict[str, str]]:
    """One row per alert Alertmanager holds: what it is, whether it pages, and what holds it back."""
    by_fp = {a.fingerprint: a for a in alerts if a.fingerprint}
    return [{"alert": a.name, "step": "" if a.step is None else str(a.step), "state": shown_state(a, by_fp),
             "since": a.starts_at, "summary": a.summary} for a in alerts]
