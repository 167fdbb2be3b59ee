"""Prometheus-style relabelling of discovered targets: a target is a dict of labels, rules run in order.

The semantics are Prometheus's ``relabel_configs`` (so a rule copied from a scrape config does
the same here): ``source_labels`` joined by ``separator`` (``;``) are matched against ``regex``
(fully anchored, default ``(.*)``); ``replacement`` (default ``$1``) may name groups as ``$1``,
``${1}`` or ``${name}``. Actions:

- ``replace`` (default): on a match, ``target_label`` becomes the expanded replacement (an empty
  result removes the label); no match, no change;
- ``keep`` / ``drop``: the target survives only if the value matches / does not match;
- ``hashmod``: ``target_label`` = MD5 of the value modulo ``modulus`` (Prometheus's digest: the
  last 8 bytes, big-endian), for spreading targets over several exporters;
- ``labelmap``: every label whose *name* matches gets copied under the expanded replacement;
- ``labeldrop`` / ``labelkeep``: labels whose names match are dropped / kept;
- ``lowercase`` / ``uppercase``: ``target_label`` = the value in lower / upper case.

Pure: no I/O; a rule is validated once (:func:`rule`), applying never raises.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

ACTIONS = ("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase", "uppercase")
_NEEDS_TARGET = frozenset({"replace", "hashmod", "lowercase", "uppercase"})
_GROUP_REF = re.compile(r"\$(?:\{(\w+)\}|(\w+))")

Labels = dict[str, str]


class RelabelError(ValueError):
    """A rule that cannot work (bad regex, missing target label, unknown action)."""


@dataclass(frozen=True)
class Rule:
    action: str = "replace"
    source_labels: tuple[str, ...] = ()
    separator: str = ";"
    regex: re.Pattern[str] = re.compile("(.*)")
    target_label: str = ""
    replacement: str = "$1"
    modulus: int = 0


def rule(raw: Mapping[str, object]) -> Rule:
    """One rule from its config mapping (the keys of Prometheus's ``relabel_config``)."""
    action = str(raw.get("action", "replace")).lower()
    if action not in ACTIONS:
        raise RelabelError(f"unknown action {action!r} (one of {', '.join(ACTIONS)})")
    pattern = str(raw.get("regex", "(.*)"))
    try:
        regex = re.compile(f"^(?:{pattern})$")
    except re.error as exc:
        raise RelabelError(f"regex {pattern!r}: {exc}") from None
    sources = raw.get("source_labels") or ()
    if not isinstance(sources, Sequence) or isinstance(sources, str):
        raise RelabelError("source_labels must be a list of label names")
    target = str(raw.get("target_label") or "")
    if action in _NEEDS_TARGET and not target:
        raise RelabelError(f"action {action} needs target_label")
    modulus = raw.get("modulus", 0)
    if action == "hashmod" and (not isinstance(modulus, int) or modulus < 1):
        raise RelabelError("action hashmod needs a positive integer modulus")
    return Rule(action=action, source_labels=tuple(str(s) for s in sources),
                separator=str(raw.get("separator", ";")), regex=regex, target_label=target,
                replacement=str(raw.get("replacement", "$1")), modulus=int(modulus or 0))


def _expand(template: str, match: re.Match[str]) -> str:
    def group(m: re.Match[str]) -> str:
        ref = m.group(1) or m.group(2)
        try:
            value = match.group(int(ref)) if ref.isdigit() else match.group(ref)
        except IndexError:  # no such group: Prometheus expands it to nothing
            return ""
        return value or ""
    return _GROUP_REF.sub(group, template)



def apply(rules: Iterable[Rule], labels: Mapping[str, str]) -> Labels | None:
    """The target's labels after ``rules``; None when a keep or drop rule drops the target."""
    out: Labels = dict(labels)
    for r in rules:
        value = r.separator.join(out.get(s, "") for s in r.source_labels)
        if r.action == "keep":
            if not r.regex.match(value):
                return None
        elif r.action == "drop":
            if r.regex.match(value):
                return None
        elif r.action == "replace":
            m = r.regex.match(value)
            if m is not None:
                target = _expand(r.target_label, m)
                result = _expand(r.replacement, m)
                if result:
                    out[target] = result
                else:
                    out.pop(target, None)
        elif r.action == "hashmod":
            digest = hashlib.md5(value.encode(), usedforsecurity=False).digest()  # Prometheus's digest
            out[r.target_label] = str(int.from_bytes(digest[8:], "big") % r.modulus)
        elif r.action == "lowercase":
            out[r.target_label] = value.lower()
        elif r.action == "uppercase":
            out[r.target_label] = value.upper()
        elif r.action == "labelmap":
            for name, v in list(out.items()):
                m = r.regex.match(name)
                if m is not None:
                    out[_expand(r.replacement, m)] = v
        elif r.action == "labeldrop":
            out = {k: v for k, v in out.items() if not r.regex.match(k)}
        elif r.action == "labelkeep":
            out = {k: v for k, v in out.items() if r.regex.match(k)}
    return out
