"""Alertmanager's view of the alerts: which page, and which the chain's inhibition holds back.

``GET /api/v2/alerts`` lists every alert Alertmanager holds with ``status.state`` (``active``:
it notifies; ``suppressed``: inhibited or silenced; ``unprocessed``: just arrived) and the
fingerprints of the alerts inhibiting it and the silences silencing it. :func:`parse_alerts`
turns that answer into :class:`PageAlert` rows (pure, tested on payloads); :func:`fetch_alerts`
is the thin HTTP edge. The v2 API answers a bare JSON list, not Prometheus's envelope, so it
has its own GET here; failures become :class:`~console.http_json.SourceUnavailable`, as for the
other sources. ``/api/v2/silences`` gives the silences, and ``/api/v2/status`` the config
Alertmanager runs, whose ``inhibit_rules`` say which alert holds back which.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import requests
import yaml

from console.http_json import SourceUnavailable, _short
from prefixscope.catalog import CHECKS_BY_ALERT

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


# ---- silences and the inhibition rules: what holds alerts back, and why ---------------------
@dataclass(frozen=True)
class Silence:
    id: str
    state: str  # active | pending | expired
    matchers: str  # as amtool writes them: alertname="X", cluster=~"a|b"
    created_by: str
    comment: str
    ends_at: str


@dataclass(frozen=True)
class InhibitRule:
    sources: tuple[str, ...]  # alert names (or matchers) that hold back ...
    targets: tuple[str, ...]  # ... these, while they fire
    equal: tuple[str, ...]  # labels both must share (the same cluster)


def _matcher_text(m: Any) -> str:
    if not isinstance(m, dict) or not isinstance(m.get("name"), str):
        raise BadAnswer("silence matcher: expected an object with a name")
    op = ("=~" if m.get("isRegex") else "=") if m.get("isEqual", True) else ("!~" if m.get("isRegex") else "!=")
    return f'{m["name"]}{op}"{m.get("value", "")}"'


def parse_silences(payload: Any) -> list[Silence]:
    """``/api/v2/silences`` JSON → rows, active first, then pending, then expired (newest end first)."""
    if not isinstance(payload, list):
        raise BadAnswer("expected a JSON list of silences")
    out = []
    for i, s in enumerate(payload):
        if not isinstance(s, dict) or not isinstance(s.get("matchers"), list):
            raise BadAnswer(f"silence {i}: expected an object with matchers")
        status = s.get("status") if isinstance(s.get("status"), dict) else {}
        out.append(Silence(str(s.get("id", "")), str(status.get("state", "")),
                           ", ".join(_matcher_text(m) for m in s["matchers"]), str(s.get("createdBy", "")),
                           str(s.get("comment", "")), str(s.get("endsAt", ""))))
    order = {"active": 0, "pending": 1, "expired": 2}
    out.sort(key=lambda s: s.ends_at, reverse=True)
    return sorted(out, key=lambda s: order.get(s.state, 3))  # stable: newest end first within a state


_ALERTNAME_ANY = re.compile(r'^alertname\s*=~\s*"(.*)"$')


def _names(matchers: Any) -> tuple[str, ...]:
    """``alertname=~"A|B"`` → (A, B); any other matcher is kept as written."""
    out: list[str] = []
    for m in matchers if isinstance(matchers, list) else ():
        text = str(m).strip()
        found = _ALERTNAME_ANY.match(text)
        out += found[1].split("|") if found else [text]
    return tuple(out)


def parse_inhibit_rules(status: Any) -> list[InhibitRule]:
    """The ``inhibit_rules`` of the config Alertmanager runs (``/api/v2/status`` → ``config.original``)."""
    config = status.get("config") if isinstance(status, dict) else None
    original = config.get("original") if isinstance(config, dict) else None
    if not isinstance(original, str):
        raise BadAnswer("status: expected config.original")
    try:
        parsed = yaml.safe_load(original) or {}
    except yaml.YAMLError as exc:
        raise BadAnswer(f"config.original is not YAML: {exc}") from None
    rules = parsed.get("inhibit_rules") if isinstance(parsed, dict) else None
    return [InhibitRule(_names(r.get("source_matchers")), _names(r.get("target_matchers")),
                        tuple(str(e) for e in r.get("equal") or ()))
            for r in rules or () if isinstance(r, dict)]


def _get(base_url: str, path: str, params: Mapping[str, Any] | None = None, timeout: float = 5.0) -> Any:
    try:
        resp = requests.get(base_url.rstrip("/") + path, params=params, timeout=timeout)
    except requests.RequestException as exc:
        raise SourceUnavailable(SOURCE, base_url, _short(exc)) from None
    if resp.status_code != 200:
        raise SourceUnavailable(SOURCE, base_url, f"HTTP {resp.status_code}: {resp.text[:200].strip()}")
    try:
        return resp.json()
    except ValueError:
        raise SourceUnavailable(SOURCE, base_url, "unexpected answer: not JSON") from None


def fetch_silences(base_url: str, timeout: float = 5.0) -> list[Silence]:
    try:
        return parse_silences(_get(base_url, "/api/v2/silences", timeout=timeout))
    except BadAnswer as exc:
        raise SourceUnavailable(SOURCE, base_url, f"unexpected answer: {exc}") from None


def fetch_inhibit_rules(base_url: str, timeout: float = 5.0) -> list[InhibitRule]:
    try:
        return parse_inhibit_rules(_get(base_url, "/api/v2/status", timeout=timeout))
    except BadAnswer as exc:
        raise SourceUnavailable(SOURCE, base_url, f"unexpected answer: {exc}") from None


def rule_rows(rules: Sequence[InhibitRule]) -> list[dict[str, str]]:
    """One row per inhibition rule, alerts by name with their diagnosis step: who holds back whom."""
    def named(names: tuple[str, ...]) -> str:
        return ", ".join(f"{n} (step {CHECKS_BY_ALERT[n].group})" if n in CHECKS_BY_ALERT else n for n in names)
    return [{"while firing": named(r.sources), "holds back": named(r.targets),
             "on the same": ", ".join(r.equal) or "—"} for r in rules]


def silence_rows(silences: Sequence[Silence]) -> list[dict[str, str]]:
    return [{"silence": s.id, "state": s.state, "matchers": s.matchers, "by": s.created_by,
             "comment": s.comment, "until": s.ends_at} for s in silences]
