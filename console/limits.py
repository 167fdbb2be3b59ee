"""The limits in force: each check's threshold, ``for`` and severity, as the console shows them.

They come from the exporter's ``/api/v1/groups``, which reports the threshold file it was started
with — the same file the deployed rules were generated from — so the console shows the limits
Prometheus evaluates whatever it reads values from. Only when no exporter answers does the console
read a threshold file itself (the ``--thresholds`` setting, :mod:`console.settings`), and it says
so. Pure: callers pass the exporter's answer or the parsed file in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from prefixscope import diagnosis
from prefixscope.catalog import CHECKS, CHECKS_BY_KEY
from prefixscope.thresholds import Thresholds

LimitSource = Literal["exporter", "file"]
DEFAULT_SEVERITY = "warning"


@dataclass(frozen=True)
class Limit:
    """One check's limit: the alert fires once ``value op threshold`` has held for ``for_s``."""

    threshold: float | None  # None: the exporter did not say (shown as unknown, never guessed)
    for_s: float | None
    severity: str = DEFAULT_SEVERITY


@dataclass(frozen=True)
class Limits:
    """Check key → its limit, and where the limits were read (for the page to say)."""

    by_check: tuple[tuple[str, Limit], ...]
    source: LimitSource
    where: str  # the exporter's URL or the threshold file's name

    def of(self, key: str) -> Limit:
        return dict(self.by_check).get(key, Limit(None, None))

    def threshold(self, key: str) -> float | None:
        return self.of(key).threshold

    @property
    def severities(self) -> dict[str, str]:
        """Threshold key → severity (what ``diagnosis.context_checks`` reads)."""
        out = {}
        for key, limit in self.by_check:
            check = CHECKS_BY_KEY.get(key)
            if check is not None:
                out[check.threshold] = limit.severity
        return out

    @property
    def context(self) -> frozenset[str]:
        """The checks marked ``info``: context, never a cause."""
        return diagnosis.context_checks(self.severities)


def limits_from_groups(groups: Mapping, where: str = "the exporter") -> Limits:
    """The limits the exporter reports with each check of ``/api/v1/groups``."""
    found: dict[str, Limit] = {}
    for step in groups.get("steps") or []:
        for raw in step.get("checks") or []:
            key = str(raw.get("key"))
            if key not in CHECKS_BY_KEY:
                continue  # a check this console does not know: a newer exporter
            severity = raw.get("severity")
            found[key] = Limit(_float(raw.get("threshold")), _float(raw.get("for_s")),
                               severity if isinstance(severity, str) and severity else DEFAULT_SEVERITY)
    return Limits(tuple(sorted(found.items())), "exporter", where)


def limits_from_file(th: Thresholds, where: str = "the threshold file") -> Limits:
    """The limits of a parsed threshold file (used only when no exporter answers)."""
    found = {c.key: Limit(th.value(c), th.for_s(c), th.checks[c.threshold].severity) for c in CHECKS}
    return Limits(tuple(sorted(found.items())), "file", where)


def _float(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v)
