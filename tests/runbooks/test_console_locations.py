"""Every console location a runbook names (``**Console → page → section**``) exists in the console.

Pages are the titles of ``console/streamlit_app.py``'s ``st.Page`` entries; sections are the
``st.subheader`` headers of the page's script (and, on the diagnosis page, one section per
catalogue step, the header it writes for each). Runbooks speak the reader's language: no
references to documents the reader does not have.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from prefixscope.catalog import STEPS

ROOT = Path(__file__).resolve().parents[2]
CONSOLE = ROOT / "console"
RUNBOOK_FILES = sorted((ROOT / "runbooks").glob("*.md"))
LOCATION = re.compile(r"\*\*Console → ([^*\n]+?)\*\*")
STEP_HEADER = "### Step {step.number} — {step.title}"


def _str_arg(call: ast.Call, index: int, keyword: str) -> str | None:
    node = call.args[index] if len(call.args) > index else next(
        (k.value for k in call.keywords if k.arg == keyword), None)
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == name]


def console_sections() -> dict[str, set[str]]:
    """Page title → its section headers, read from the console's sources."""
    app = ast.parse((CONSOLE / "streamlit_app.py").read_text(encoding="utf-8"))
    consts = {t.id: n.value.value for n in ast.walk(app) if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    pages: dict[str, set[str]] = {}
    for call in _calls(app, "Page"):
        title = _str_arg(call, 99, "title")
        first = call.args[0]
        script = first.value if isinstance(first, ast.Constant) else consts.get(getattr(first, "id", ""))
        assert title and isinstance(script, str), ast.unparse(call)
        source = (CONSOLE / script).read_text(encoding="utf-8")
        headers = {h for c in _calls(ast.parse(source), "subheader") if (h := _str_arg(c, 0, "body"))}
        if STEP_HEADER in source:
            headers |= {f"Step {s.number} — {s.title}" for s in STEPS}
        pages.setdefault(title, set()).update(headers)
    return pages


def test_the_console_has_the_sections_runbooks_rely_on() -> None:
    sections = console_sections()
    assert {"Liveness", "Blocks against capacity"} <= sections["Workers & topology"]
    assert {"Hot branches", "What changed"} <= sections["Prefix tree"]
    assert {"Reuse decomposition", "Step 0 — Telemetry", "Step 5 — Coupled optimisations"} <= sections["Diagnosis chain"]


@pytest.mark.parametrize("path", RUNBOOK_FILES, ids=lambda p: p.name)
def test_every_console_location_exists(path: Path) -> None:
    sections = console_sections()
    text = path.read_text(encoding="utf-8")
    wrong = []
    for location in LOCATION.findall(text):
        parts = [p.strip() for p in location.split("→")]
        page = parts[0]
        if page not in sections or len(parts) > 2 or (len(parts) == 2 and parts[1] not in sections[page]):
            wrong.append(location)
    assert wrong == [], f"{path.name} names console locations that do not exist: {wrong}"


@pytest.mark.parametrize("path", RUNBOOK_FILES, ids=lambda p: p.name)
def test_runbooks_explain_in_their_own_words(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    assert not re.search(r"\bseed\b|§|\bcorollary\b", text, flags=re.I), path.name


def test_console_locations_are_written_one_way() -> None:
    """Every alert runbook sends the reader to the console in the recognisable form."""
    for path in RUNBOOK_FILES:
        if path.stem.startswith("Prefix"):
            assert LOCATION.search(path.read_text(encoding="utf-8")), path.name
