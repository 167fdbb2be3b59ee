"""Culprits of a check as the exporter reports them (docs/api.md), as typed rows (pure).

The exporter names, per breaching check, the workers, prefixes, sessions and nodes driving its
number. A malformed or missing part is left out, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixscope.units import format_reading as fmt


@dataclass(frozen=True)
class WorkerCulprit:
    worker: str
    value: float | None
    measure: str
    unit: str
    node: str | None


@dataclass(frozen=True)
class PrefixCulprit:
    branch: str
    text: str | None  # the first words of the branch, when the exporter serves prefix text
    token_ids: tuple[int, ...]  # its first tokens, when text is not (yet) known
    workers: tuple[str, ...]
    hit_tokens: float | None
    lost_hit_tokens: float | None

    @property
    def name(self) -> str:
        """``"You are a support agent…"`` or ``tokens 12 54 …`` or nothing, for a person."""
        if self.text:
            return f"“{self.text}”"
        if self.token_ids:
            shown = " ".join(str(t) for t in self.token_ids[:8])
            return f"tokens {shown}{' …' if len(self.token_ids) > 8 else ''}"
        return ""


@dataclass(frozen=True)
class SessionCulprit:
    session: str
    worker: str | None
    hit_ratio: float | None


def _shown(text: str | None, tokens: tuple[int, ...]) -> str:
    if text:
        return f"“{text}”"
    shown = " ".join(str(t) for t in tokens[:8])
    return f"tokens {shown}{' …' if len(tokens) > 8 else ''}" if tokens else ""


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
        """One markdown line per kind of culprit that has any."""
        out = []
        if self.near_duplicates:
            out.append("**Near-duplicate prefixes**: " + "; ".join(p.line() for p in self.near_duplicates))
        if self.workers:
            w0 = self.workers[0]
            items = ", ".join(f"`{w.worker}` ({fmt(w.value, w.unit)})" if w.unit else f"`{w.worker}`"
                              for w in self.workers)
            out.append(f"**Workers** by {w0.measure}: {items}")
        if self.prefixes:
            items = "; ".join(
                f"`{p.branch}` {p.name}".rstrip() + (f" on {', '.join(p.workers)}" if p.workers else "")
                for p in self.prefixes)
            out.append(f"**Prefixes**: {items}")
        if self.sessions:
            items = ", ".join(f"`{s.session}` ({fmt(s.hit_ratio, 'ratio')} reused" +
                              (f", on {s.worker})" if s.worker else ")") for s in self.sessions)
            out.append(f"**Sessions** reusing least: {items}")
        if self.nodes:
            out.append(f"**Nodes**: {', '.join(f'`{n}`' for n in self.nodes)}")
        return out


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
                                  str(r.get("unit") or ""), _str(r.get("node")))
                    for r in _rows(raw, "workers") if _str(r.get("worker")))
    prefixes = tuple(PrefixCulprit(
        str(r["branch"]), _str(r.get("text")),
        tuple(t for t in (r.get("token_ids") or []) if isinstance(t, int) and not isinstance(t, bool)),
        tuple(str(w) for w in (r.get("workers") or []) if isinstance(w, str)),
        _num(r.get("hit_tokens")), _num(r.get("lost_hit_tokens")))
        for r in _rows(raw, "prefixes") if _str(r.get("branch")))
    sessions = tuple(SessionCulprit(str(r["session"]), _str(r.get("worker")), _num(r.get("hit_ratio")))
                     for r in _rows(raw, "sessions") if _str(r.get("session")))
    nodes = tuple(str(r["node"]) for r in _rows(raw, "nodes") if _str(r.get("node")))
    pairs = tuple(NearDuplicatePair(
        str(r["new_root"]), str(r["recent_root"]), _int(r.get("span_offset")) or 0, _int(r.get("span_length")) or 0,
        _str(r.get("new_text")), _str(r.get("recent_text")), _ints(r.get("new_token_ids")),
        _ints(r.get("recent_token_ids")))
        for r in _rows(raw, "near_duplicates")
        if _str(r.get("new_root")) and _str(r.get("recent_root")) and _int(r.get("span_length")) is not None)
    return Culprits(workers, prefixes, sessions, nodes, pairs)
