"""A missing tool skips a test on a developer's machine and fails it under CI."""

from __future__ import annotations

import pytest

from tests.support import require_tool


@pytest.mark.parametrize("ci", ["true", "1"])
def test_a_missing_tool_fails_under_ci(monkeypatch: pytest.MonkeyPatch, ci: str) -> None:
    monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.fail.Exception, match="no-such-tool-here is not installed"):
        require_tool("no-such-tool-here")


@pytest.mark.parametrize("ci", [None, "", "false"])
def test_a_missing_tool_skips_locally(monkeypatch: pytest.MonkeyPatch, ci: str | None) -> None:
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    with pytest.raises(pytest.skip.Exception):
        require_tool("no-such-tool-here")


def test_a_present_tool_is_its_path() -> None:
    assert require_tool("sh").endswith("/sh")
