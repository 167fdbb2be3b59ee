"""The banner on every page says what the running fleet announced last (the demo's storyline)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from console.announcements import latest, parse
from console.settings import ANNOUNCE_ENV
from tests.console.test_pages import APP


def test_only_well_formed_lines_count_and_the_newest_comes_first(tmp_path: Path) -> None:
    assert parse('{"ts": 1, "text": "a"}\n{"ts": true, "text": "b"}\nnot json\n{"ts": 2, "text": "c"}') == [
        *parse('{"ts": 1, "text": "a"}'), *parse('{"ts": 2, "text": "c"}')]
    assert latest(tmp_path / "missing.jsonl") == []
    path = tmp_path / "news.jsonl"
    path.write_text("".join(json.dumps({"ts": i, "text": f"t{i}"}) + "\n" for i in range(10)))
    assert [a.text for a in latest(path, 3)] == ["t9", "t8", "t7"]


def test_every_page_shows_the_newest_announcement(monkeypatch: pytest.MonkeyPatch, exporter_only: str,
                                                  tmp_path: Path) -> None:
    path = tmp_path / "news.jsonl"
    now = time.time()
    path.write_text(json.dumps({"ts": now - 200, "text": "step 1 of 3: dropped-kv-events — healthy for 2 m"}) + "\n"
                    + json.dumps({"ts": now - 40, "text": "worker w0 restored (restarted between scenarios)"}) + "\n")
    monkeypatch.setenv(ANNOUNCE_ENV, str(path))
    at = AppTest.from_file(APP, default_timeout=30).run()
    assert not at.exception
    banner = at.info[0].value
    assert banner.startswith("**Now running** · 4") and " s ago (" in banner and banner.endswith(
        "): worker w0 restored (restarted between scenarios)"), banner
    at.switch_page("app_pages/workers.py").run()
    assert not at.exception
    assert at.info[0].value.startswith("**Now running** · ")
