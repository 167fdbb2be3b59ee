"""Threshold profiles: named overlays on alerts/thresholds.yaml (``alerts/profiles/<name>.yaml``).

A profile changes what a setting needs and nothing else: the demo's profile (``demo.yaml``) has
shorter windows and ``for`` durations, so a fault fires within the minutes the demo gives it.
Its rules come from the same catalogue, wording and generator as the committed ones; only the
numbers differ. The overlay changes, per check, the fields it names (``value``, ``for``,
``severity``); the result is validated as a thresholds file, so a profile cannot name a check the
catalogue lacks or a duration Prometheus cannot read.

A profile keeps the rate window: the catalogue's expressions (and the exporter's quantile
checks, which read the catalogue's ``[5m]`` histograms) are written for it. A fault reaches its
threshold within a fraction of the window anyway; what makes an alert slow is its ``for``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from prefixscope import thresholds as config
from prefixscope.validation import Problems, read_yaml

PROFILE_DIR = Path(__file__).resolve().parent
PROFILE_KEYS = ("description", "checks")
ENTRY_KEYS = ("value", "for", "severity", "keep_firing_for")


def names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.yaml"))


def profile_path(name: str) -> Path:
    """A profile by name (``demo``) or by path; :class:`ConfigError` names the known ones otherwise."""
    p = PROFILE_DIR / f"{name}.yaml"
    if p.is_file():
        return p
    if Path(name).is_file():
        return Path(name)
    raise config.ConfigError([f"unknown threshold profile {name!r}; profiles: {', '.join(names()) or 'none'}"])


def overlay(base: dict[str, Any], profile: Any, source: str) -> dict[str, Any]:
    """``base`` (a parsed thresholds file) with ``profile`` laid over it; problems name ``source``."""
    problems = Problems(source)
    if not isinstance(profile, dict):
        problems.add("", "expected a mapping of settings to change")
        problems.raise_if_any(config.ConfigError)
    for key in profile:
        if key not in PROFILE_KEYS:
            problems.add(str(key), f"unknown setting; a profile may change {', '.join(PROFILE_KEYS)}")
    out = {k: v for k, v in base.items()}
    checks = {k: dict(v) for k, v in (base.get("checks") or {}).items()}
    raw = profile.get("checks") or {}
    if not isinstance(raw, dict):
        problems.add("checks", "expected a mapping of check keys to the fields to change")
        raw = {}
    for key, entry in raw.items():
        if key not in checks:
            problems.add(f"checks.{key}", "unknown key: alerts/thresholds.yaml has no such check")
            continue
        if not isinstance(entry, dict) or any(f not in ENTRY_KEYS for f in entry):
            problems.add(f"checks.{key}", f"expected a mapping of {', '.join(ENTRY_KEYS)}")
            continue
        checks[key].update(entry)
    problems.raise_if_any(config.ConfigError)
    out["checks"] = checks
    return out


def load_raw(name: str, base_path: Path = config.DEFAULT_PATH) -> dict[str, Any]:
    """The profile laid over the thresholds file, as a thresholds document (validated)."""
    path = profile_path(name)
    source = f"alerts/profiles/{path.name}" if path.parent == PROFILE_DIR else str(path)
    base = read_yaml(base_path, str(base_path.name), config.ConfigError)
    merged = overlay(base, read_yaml(path, source, config.ConfigError), source)
    config.parse(merged, source)
    return merged


def load(name: str, base_path: Path = config.DEFAULT_PATH) -> config.Thresholds:
    return config.parse(load_raw(name, base_path), f"alerts/profiles/{name}")


def thresholds_yaml(name: str) -> str:
    """The merged thresholds file of a profile, for an exporter's ``thresholds:`` setting."""
    return (f"# alerts/thresholds.yaml with the threshold profile {name!r} laid over it "
            "(written by prefixscope; do not edit).\n" + yaml.safe_dump(load_raw(name), sort_keys=False))


def rule_file(name: str) -> str:
    """The Prometheus rule file of a profile (the generator's, with the profile's numbers)."""
    from alerts import generate  # the generator imports dashboards; only a caller that writes rules pays

    text = generate.build(load(name))[generate.ROOT / "alerts" / "generated" / generate.RULES_FILE]
    body = text.removeprefix(generate.HEADER)
    return (f"# Generated from prefixscope/catalog.py, alerts/thresholds.yaml and the threshold profile {name!r}.\n"
            + body)
