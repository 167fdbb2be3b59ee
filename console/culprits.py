"""Culprits of a check as the exporter reports them (docs/api.md), as typed rows (pure).

The exporter names, per breaching check, the workers, prefixes, sessions and nodes whose own
value for *that* check departs from their peers', each with why it is listed (``why``). A check
without a per-entity series lists none. A malformed or missing part is left out, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from console import prefixes
from prefixscope.units import format_reading as fmt


@dataclass(frozen=True)
class WorkerCulprit:
    worker: str
    value: float | None
    measure: str
    unit: str
    node: str | None
    why: str | None = None  # "w1: 86 s since its last KV event; the others ≤ 5 s"

    def line(self) -> str:
        if self.why:
            return self.why
        return f"{self.worker}: {fmt(self.value, self.unit)} {self.measure}" if self.unit else self.worker


@dataclass(frozen=True)
class PrefixCulprit:
    branch: str
    text: str | None  # the words of the branch, when the exporter serves prefix text
    token_ids: tuple[int, ...]  # its first tokens, when text is not (yet) known
    workers: tuple[str, ...]
    hit_tokens: float | None
    lost_hit_tokens: float | None
    tenant: str | None = None
    adapter: str | None = None
    why: str | None = None

    @property
    def name(self) -> str:
        """``“You are a support agent…” (tenant acme)`` or ``tokens 12 54 …`` or nothing, for a person."""
        words = prefixes.words(self.text, self.token_ids)
        who = prefixes.owner(self.tenant, self.adapter)
        return f"{words} ({who})" if words and who else words or (f"({who})" if who else "")

    @property
    def full(self) -> str:
        """The whole text the exporter serves (for an expander), with whose it is."""
        words = prefixes.words(self.text, self.token_ids, limit=None)
        who = prefixes.owner(self.tenant, self.adapter)
        return f"{words} ({who})" if words and who else words


@dataclass(frozen=True)
class SessionCulprit:
    session: str
    worker: str | None
    hit_ratio: float | None
    why: str | None = None

    def line(self) -> str:
        base = self.why or f"{self.session}: {fmt(self.hit_ratio, 'ratio')} of its follow-up tokens cached"
        return base + (f" (on {self.worker})" if self.worker else "")


def _shown(text: str | None, tokens: tuple[int, ...]) -> str:
    return prefixes.words(text, tokens)


@dataclass(frozen=True)
class NearDuplicatePair:
    """Two root branches whose openings are the same but for a short early span (prefix instability)."""

    new_root: str
    recent_root: str
    span_offset: int
    span_length: int
    new_text: str | None
    recent_text: str | None
    new_token_ids: tuple[int, ...]
    recent_token_ids: tuple[int, ...]

    def line(self) -> str:
        first, last = self.span_offset + 1, self.span_offset + self.span_length
        new = f"new root `{self.new_root}` {_shown(self.new_text, self.new_token_ids)}".rstrip()
        recent = f"recent root `{self.recent_root}` {_shown(self.recent_text, self.recent_token_ids)}".rstrip()
        return f"{new} repeats {recent} but for tokens {first}–{last} ({self.span_length} tokens)"


@dataclass(frozen=True)
class Culprits:
    workers: tuple[WorkerCulprit, ...] = ()
    prefixes: tuple[PrefixCulprit, ...] = ()
    sessions: tuple[SessionCulprit, ...] = ()
    nodes: tuple[str, ...] = ()
    near_duplicates: tuple[NearDuplicatePair, ...] = ()

    def lines(self) -> list[str]:
        """One markdown line per kind of culprit that has any, each saying why it is listed."""
        out = []
        if self.near_duplicates:
            out.append("**Near-duplicate prefixes**: " + "; ".join(p.line() for p in self.near_duplicates))
        if self.workers:
            out.append("**Workers**: " + " · ".join(w.line() for w in self.workers))
        if self.prefixes:
            items = " · ".join(
                f"`{p.branch}` {p.name}".rstrip() + (f": {p.why}" if p.why else "") +
                (f" (on {', '.join(p.workers)})" if p.workers else "") for p in self.prefixes)
            out.append(f"**Prefixes**: {items}")
        if self.sessions:
            out.append("**Sessions**: " + " · ".join(s.line() for s in self.sessions))
        if self.nodes:
            out.append(f"**Nodes**: {', '.join(f'`{n}`' for n in self.nodes)}")
        return out

    @property
    def any(self) -> bool:
        return bool(self.workers or self.prefixes or self.sessions or self.nodes or self.near_duplicates)


def _num(v: object) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def _rows(raw: dict, key: str) -> list[dict]:
    value = raw.get(key)
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def _ints(v: object) -> tuple[int, ...]:
    return tuple(t for t in v if isinstance(t, int) and not isinstance(t, bool)) if isinstance(v, list) else ()


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def parse_culprits(raw: object) -> Culprits | None:
    """The ``culprits`` object of one check, or None when there is none."""
    if not isinstance(raw, dict):
        return None
    workers = tuple(WorkerCulprit(str(r["worker"]), _num(r.get("value")), str(r.get("measure") or "value"),
                                  str(r.get("unit") or ""), _str(r.get("node")), _str(r.get("why")))
                    for r in _rows(raw, "workers") if _str(r.get("worker")))
    prefixes = tuple(PrefixCulprit(
        str(r["branch"]), _str(r.get("text")),
        tuple(t for t in (r.get("token_ids") or []) if isinstance(t, int) and not isinstance(t, bool)),
        tuple(str(w) for w in (r.get("workers") or []) if isinstance(w, str)),
        _num(r.get("hit_tokens")), _num(r.get("lost_hit_tokens")), _str(r.get("tenant")), _str(r.get("adapter")),
        _str(r.get("why")))
        for r in _rows(raw, "prefixes") if _str(r.get("branch")))
    sessions = tuple(SessionCulprit(str(r["session"]), _str(r.get("worker")), _num(r.get("hit_ratio")),
                                    _str(r.get("why")))
                     for r in _rows(raw, "sessions") if _str(r.get("session")))
    nodes = tuple(str(r["node"]) for r in _rows(raw, "nodes") if _str(r.get("node")))
    pairs = tuple(NearDuplicatePair(
        str(r["new_root"]), str(r["recent_root"]), _int(r.get("span_offset")) or 0, _int(r.get("span_length")) or 0,
        _str(r.get("new_text")), _str(r.get("recent_text")), _ints(r.get("new_token_ids")),
        _ints(r.get("recent_token_ids")))
        for r in _rows(raw, "near_duplicates")
        if _str(r.get("new_root")) and _str(r.get("recent_root")) and _int(r.get("span_length")) is not None)
    return Culprits(workers, prefixes, sessions, nodes, pairs)
