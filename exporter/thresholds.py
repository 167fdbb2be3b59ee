"""Thresholds for the exporter's own check evaluation, read from alerts/thresholds.yaml.

The file format and its validation (unknown key, wrong type, a catalogue check without an
entry → an error naming the entry) are defined once, in :mod:`alerts.config`; this module only
adds what the exporter needs on top: the window in seconds and a value per check.
"""

from __future__ import annotations

from pathlib import Path

from alerts.config import DEFAULT_PATH, ConfigError, Thresholds, load, parse
from exporter.catalog import Check
from exporter.config import parse_duration


def load_thresholds(path: str | Path | None = None) -> Thresholds:
    """Read and validate the threshold file (alerts/thresholds.yaml by default)."""
    return load(Path(path) if path is not None else DEFAULT_PATH)


def window_seconds(thresholds: Thresholds) -> float:
    return parse_duration(thresholds.window)


def threshold_value(thresholds: Thresholds, check: Check) -> float:
    return thresholds.checks[check.threshold].value


__all__ = ["ConfigError", "Thresholds", "load_thresholds", "parse", "threshold_value", "window_seconds"]
