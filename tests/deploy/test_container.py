"""The Containerfile builds an image that runs the exporter, non-root, on the compiled core.

It needs a working container engine (docker or podman, with its daemon or service up) and the
base image (present, or pullable from its registry). Where either is missing the test skips and
says which, under CI too: a container engine is not part of the test toolchain.
"""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests import support

pytestmark = pytest.mark.slow

BASE_IMAGE = "python:3.11-slim"
ENGINES = ("docker", "podman")
# Beyond loopback the record intake needs a token; the image's own smoke run turns it off.
# No writer (records, OTLP, the reload endpoint): beyond loopback it needs no token.
CONFIG = "workers: []\nrecords:\n  http:\n    enabled: false\notlp:\n  enabled: false\nweb:\n  reload: false\n"


def _engine() -> str:
    reasons = []
    for name in ENGINES:
        path = shutil.which(name)
        if path is None:
            reasons.append(f"{name}: not installed")
            continue
        info = subprocess.run([path, "info"], capture_output=True, text=True, timeout=60)
        if info.returncode == 0:
            return path
        reasons.append(f"{name}: {(info.stderr.strip().splitlines() or ['no answer'])[-1]}")
    pytest.skip("no working container engine (" + "; ".join(reasons) + ")")


def _base_image(engine: str) -> None:
    if subprocess.run([engine, "image", "inspect", BASE_IMAGE], capture_output=True, timeout=60).returncode == 0:
        return
    pulled = subprocess.run([engine, "pull", BASE_IMAGE], capture_output=True, text=True, timeout=600)
    if pulled.returncode != 0:
        pytest.skip(f"base image {BASE_IMAGE} is not available ({pulled.stderr.strip()[-300:]})")


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        return response.read().decode()


def test_image_builds_and_runs_the_exporter(tmp_path: Path) -> None:
    engine = _engine()
    _base_image(engine)
    tag = f"prefixscope-test:{uuid.uuid4().hex[:12]}"
    build = subprocess.run([engine, "build", "-f", "Containerfile", "-t", tag, "."], cwd=support.REPO,
                           capture_output=True, text=True, timeout=1800)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-6000:]
    name = f"prefixscope-test-{uuid.uuid4().hex[:12]}"
    try:
        usage = subprocess.run([engine, "run", "--rm", tag, "--help"], capture_output=True, text=True, timeout=120)
        assert usage.returncode == 0 and usage.stdout.startswith("usage: prefixscope"), usage.stderr
        uid = subprocess.run([engine, "run", "--rm", "--entrypoint", "id", tag, "-u"],
                             capture_output=True, text=True, timeout=120)
        assert uid.stdout.strip() not in ("", "0"), f"runs as uid {uid.stdout.strip()!r}"

        config = tmp_path / "exporter.yaml"
        config.write_text(CONFIG, encoding="utf-8")
        config.chmod(0o644)
        port = support.free_port()
        started = subprocess.run(
            [engine, "run", "-d", "--name", name, "-p", f"127.0.0.1:{port}:9400",
             "-v", f"{config}:/etc/prefixscope/exporter.yaml:ro", tag,
             "export", "--config.file", "/etc/prefixscope/exporter.yaml", "--web.listen-address", "0.0.0.0:9400"],
            capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stderr
        url = f"http://127.0.0.1:{port}"
        support.wait_for(lambda: _get(f"{url}/healthz"), "/healthz in the container", timeout=120,
                         ignore=(OSError, AssertionError))
        info = re.search(r"^prefixscope_exporter_build_info\{([^}]*)\} 1", _get(f"{url}/metrics"), re.M)
        assert info is not None and 'core="compiled"' in info[1], info
    finally:
        logs = subprocess.run([engine, "logs", name], capture_output=True, text=True, timeout=60)
        subprocess.run([engine, "rm", "-f", name], capture_output=True, timeout=120)
        with contextlib.suppress(subprocess.SubprocessError):
            subprocess.run([engine, "rmi", "-f", tag], capture_output=True, timeout=120)
    assert "prefix index: the compiled core" in logs.stdout + logs.stderr
