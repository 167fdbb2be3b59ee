"""What one dashboard is drawn with, and what it hands back: the context the generator passes in.

A ``*.dashboard.py`` file holds ``build(drawing: Drawing) -> Drawn``. The generator makes one
``Drawing`` per dashboard from the threshold file it was given (``prefixscope generate
--thresholds FILE``), so nothing reads the file behind its back and no module keeps it in a
global. The panels a dashboard marks with :meth:`Drawing.shows` come back as ``{alert: panel_id}``:
the generated rules link each alert to its panel from that map.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from grafanalib import core as g

from prefixscope.catalog import Check
from prefixscope.thresholds import CheckThreshold, Thresholds

P = TypeVar("P", bound=g.Panel)


@dataclass
class Drawing:
    thresholds: Thresholds
    # id() of a panel as built → the alert it shows. Panels are immutable attrs values that layout
    # copies, so the mark is kept beside them, keyed by the object the dashboard file built.
    _alert_of: dict[int, str] = field(default_factory=dict)

    @property
    def window(self) -> str:
        """The rate window (the recording rules' window)."""
        return self.thresholds.window

    def entry(self, check: Check) -> CheckThreshold:
        return self.thresholds.checks[check.threshold]

    def runbook_url(self, alert: str) -> str:
        return self.thresholds.runbook_url(alert)

    def shows(self, panel: P, alert: str) -> P:
        """Mark ``panel`` as the one that shows ``alert`` (its panel link points here)."""
        self._alert_of[id(panel)] = alert
        return panel

    def alert_panels(self, built: Sequence[g.Panel], dashboard: g.Dashboard) -> dict[str, int]:
        """Alert → panel id, for the marked panels of ``built`` laid out, in order, as ``dashboard``."""
        placed = dashboard.panels
        if len(placed) != len(built):
            raise ValueError(f"{dashboard.title}: {len(built)} panels built, {len(placed)} laid out")
        return {self._alert_of[id(b)]: int(p.id) for b, p in zip(built, placed, strict=True)
                if id(b) in self._alert_of}


@dataclass(frozen=True)
class Drawn:
    """A finished dashboard and the panel each of its alerts is shown on."""

    dashboard: g.Dashboard
    alert_panels: dict[str, int]
