"""Helpers the test files share: waiting on conditions, ports, and tools that may be missing.

Waits poll a condition rather than sleep a fixed time; their timeouts are safety nets for a
hung process, generous enough for a busy 2-core machine, not budgets the code must meet.

A test that needs an outside tool (promtool, Prometheus, Chromium, the router venv) skips
when it is missing on a developer's machine but fails under CI (``CI`` set to anything but
``false``/``0``), where the tool is always installed and a skip would hide a broken setup.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn, TypeVar

import pytest

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
ROUTERS_BIN = REPO / ".routers" / "bin"
PEERS = REPO / ".peers"  # the peers' own runtimes, one venv each (make peers)

# How each tool is installed, for the skip/fail message.
INSTALL_HINTS = {
    "promtool": "apt-get install prometheus",
    "prometheus": "apt-get install prometheus",
    "chromium": "apt-get install chromium",
    "nats-server": "apt-get install nats-server",
    "prometheus-alertmanager": "apt-get install prometheus-alertmanager",
    "amtool": "apt-get install prometheus-alertmanager",
    "routers": "make routers",
    "peers": "make peers",
}


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def unavailable(message: str) -> NoReturn:
    """Skip locally; fail under CI, where everything the suite needs is installed."""
    if in_ci():
        pytest.fail(f"{message} (CI must provide it)", pytrace=False)
    pytest.skip(message)


def require_tool(name: str) -> str:
    """The path of executable ``name`` (on PATH or as an absolute path); skip/fail when missing."""
    found = shutil.which(name)
    if found is None:
        hint = INSTALL_HINTS.get(Path(name).name)
        unavailable(f"{name} is not installed" + (f" ({hint})" if hint else ""))
    return found


def require_routers_bin() -> Path:
    """The bin folder of the `.routers` venv (sglang-router, vllm-router); skip/fail without it."""
    if not (ROUTERS_BIN / "python").exists():
        unavailable(f"the router venv .routers is missing ({INSTALL_HINTS['routers']})")
    return ROUTERS_BIN


def require_peer_python(venv: str) -> Path:
    """The Python of the peer venv ``.peers/<venv>`` (e.g. dynamo-1.6.1); skip/fail without it."""
    python = PEERS / venv / "bin" / "python"
    if not python.exists():
        unavailable(f"the peer venv .peers/{venv} is missing ({INSTALL_HINTS['peers']})")
    return python


def require_file(path: Path, what: str) -> Path:
    if not path.is_file():
        unavailable(f"{what} is missing ({path.name} not found)")
    return path


def wait_for(condition: Callable[[], T], what: str = "condition", timeout: float = 30.0, every: float = 0.02,
             ignore: tuple[type[BaseException], ...] = ()) -> T:
    """Poll ``condition`` until it returns something truthy, and return that.

    Exceptions of the types in ``ignore`` count as "not yet" (a server still starting).
    """
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = condition()
            if last:
                return last  # type: ignore[return-value]
        except ignore as exc:
            last = exc
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what} (last: {last!r})")
        time.sleep(every)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (also a port to find closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether ``port`` on 127.0.0.1 can be bound (nothing listens on it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def read_until(stream: IO[str], pattern: str, seen: list[str] | None = None) -> re.Match[str]:
    """Read lines from a child's output until one matches ``pattern``; fail if the stream ends first.

    No clock: a child that is slow to start is waited for (pytest's timeout is the safety net),
    one that exits ends the stream and fails here with everything it printed.
    """
    lines = seen if seen is not None else []
    for line in iter(stream.readline, ""):
        lines.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"output ended before a line matching {pattern!r}:\n" + "".join(lines))
