"""The fleet announces each storyline step and each killed or restored worker, with its time.

Through a real ``prefixscope sim``: its log lines start with a timestamp, and the announcements
file (``--announce``, what the console's banner reads) holds one JSON object a line.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import requests

from fleet.announce import KEEP, Announcer

ROOT = Path(__file__).resolve().parents[2]
STAMPED = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ")


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_each_storyline_step_is_announced_and_logged_with_its_time(tmp_path: Path) -> None:
    news = tmp_path / "news.jsonl"
    out = subprocess.run([sys.executable, "-m", "prefixscope", "sim", "--storyline", "short", "--duration", "1",
                          "--workers", "2", "--announce", str(news)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    texts = [a["text"] for a in _read(news)]
    assert [t.split(":")[0] for t in texts] == ["step 1 of 3", "step 2 of 3", "step 3 of 3"]
    assert texts[1].startswith("step 2 of 3: session-key-churn — healthy for 4 m, then the fault: ")
    lines = [line for line in out.stdout.splitlines() if line.strip()]
    assert lines and all(STAMPED.match(line) for line in lines), lines[:5]


def test_a_killed_and_restored_worker_is_announced(tmp_path: Path) -> None:
    news, manifest = tmp_path / "news.jsonl", tmp_path / "fleet.json"
    proc = subprocess.Popen([sys.executable, "-m", "prefixscope", "sim", "--no-traffic", "--workers", "2",
                             "--manifest", str(manifest), "--announce", str(news)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not manifest.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the fleet did not start"
            time.sleep(0.1)
        data = json.loads(manifest.read_text())
        control, worker = data["control"], data["workers"][1]["name"]
        assert requests.post(f"{control}/workers/{worker}/kill", timeout=15).status_code == 200
        assert requests.post(f"{control}/workers/{worker}/restart", timeout=15).status_code == 200
        assert [a["text"] for a in _read(news)] == [f"control: {worker} killed", f"control: {worker} restarted"]
    finally:
        proc.terminate()
        proc.wait(20)


def test_the_announcements_file_keeps_its_newest_lines(tmp_path: Path) -> None:
    path = tmp_path / "news.jsonl"
    clock = iter(range(10_000))
    news = Announcer(path, out=open(tmp_path / "out.log", "w"), clock=lambda: float(next(clock)))  # noqa: SIM115
    for i in range(2 * KEEP + 5):
        news.say(f"line {i}")
    kept = _read(path)
    assert len(kept) <= 2 * KEEP and kept[-1] == {"ts": float(2 * KEEP + 4), "text": f"line {2 * KEEP + 4}"}
