"""The exporter and the simulated fleet load without each other, as processes really start.

import-linter (``make lint``) checks the static imports; this checks what a fresh interpreter
actually loads, lazy and dynamic imports included, for each program's entry module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOP_LEVEL = ("prefixscope", "exporter", "fleet", "alerts", "dashboards", "console", "lab")


def loaded_packages(module: str) -> set[str]:
    """The repo's top-level packages in sys.modules after ``import module`` in a fresh interpreter."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {name.split(".")[0] for name in json.loads(done.stdout)} & set(TOP_LEVEL)


@pytest.mark.parametrize(("entry", "must_not_load"), [
    ("exporter.main", "fleet"),
    ("fleet.cli", "exporter"),
])
def test_one_program_does_not_load_the_other(entry: str, must_not_load: str) -> None:
    loaded = loaded_packages(entry)
    assert entry.split(".")[0] in loaded
    assert must_not_load not in loaded and "lab" not in loaded, sorted(loaded)


def test_the_bottom_package_loads_alone() -> None:
    assert loaded_packages("prefixscope.diagnosis") == {"prefixscope"}
