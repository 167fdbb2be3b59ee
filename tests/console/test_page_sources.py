"""Console scripts hold no bare expressions: Streamlit "magic" would write them onto the page.

Streamlit runs each page with magic on: an expression statement that is not a call — a name, a
conditional expression ``st.dataframe(a) if rows else st.caption(b)``, a comparison — is passed
to ``st.write``, which renders its value (for a Streamlit element: the API's documentation).
Docstrings are the one exception Streamlit skips, and so does this check.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

CONSOLE = Path(__file__).resolve().parents[2] / "console"
SCRIPTS = sorted([CONSOLE / "streamlit_app.py", *(CONSOLE / "app_pages").glob("*.py")])


def bare_expressions(source: str) -> list[str]:
    """``line: code`` of each expression statement that is neither a call, a docstring nor ``...``."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0]))
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Expr) or id(node) in docstrings:
            continue
        value = node.value
        if isinstance(value, ast.Call | ast.Await | ast.Yield | ast.YieldFrom):
            continue
        if isinstance(value, ast.Constant) and value.value is Ellipsis:
            continue
        out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


def test_the_check_finds_what_magic_would_render() -> None:
    src = '"""doc"""\nimport streamlit as st\nrows = []\nst.dataframe(rows) if rows else st.caption("None.")\nrows\nst.write(1)\n'
    assert bare_expressions(src) == ['4: st.dataframe(rows) if rows else st.caption(\'None.\')', "5: rows"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_no_bare_expressions(script: Path) -> None:
    assert bare_expressions(script.read_text(encoding="utf-8")) == []
