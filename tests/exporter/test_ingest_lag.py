"""An exporter that cannot keep up with its KV streams says so, sheds into the replay, and recovers.

A real exporter (``Runtime``: its HTTP server, its ZMQ subscriber, its breach loop) follows one
worker: a separate process with a ZMQ PUB socket and a ROUTER replay socket that publishes batches
in vLLM's format, stamped with the time it sends them. While the exporter's applies are slowed (as a
core too busy would slow them) the worker bursts far more batches than the exporter's receive queue
holds. Then, through the exporter's own /api/v1/groups and /metrics: the lag rises past the
``kv_ingest_lag`` threshold and its alert fires; what did not fit was shed (a sequence gap, counted
as missed batches) instead of queued; the worker's replay heals the gap, nothing is lost; once the
exporter has caught up its lag reads 0 again and the alert clears.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests
import yaml

from exporter.config import Config, WorkerTarget
from exporter.main import Runtime
from prefixscope import thresholds
from tests.kv_publisher_process import script
from tests.support import wait_for

KEY = "kv_ingest_lag"
TOPIC = "kv@w0@m"
BURST = 6000  # batches published at once: several times what the queues between the two processes hold
SLOW_APPLY_S = 0.005  # each apply while the exporter is "short of CPU": 200 batches/s at most

# The worker: XPUB (to see the subscription) and ROUTER (the replay), as vLLM's publisher binds them.
# ``burst N`` publishes N batches as fast as it can; each is stamped with its send time and stores the
# same 64 families of 256 blocks again and again (so the index stays small while the bytes flow).
_WORKER = script(r"""
TOPIC, BLOCKS = sys.argv[1].encode(), 256
stamps = []
def numbered(seq):
    stamps.append(time.time())
def payload(seq):
    fam = seq % 64
    hashes = [(fam << 20) + i for i in range(BLOCKS)]
    return msgpack.packb([stamps[seq], [{"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": None,
        "token_ids": [fam] * (16 * BLOCKS), "block_size": 16, "lora_id": None, "medium": "GPU"}], 0])
""")


def _thresholds(directory: Path) -> Path:
    """The packaged thresholds with the lag alert at 2 s for 2 s (a test does not wait minutes)."""
    doc = yaml.safe_load(thresholds.DEFAULT_PATH.read_text(encoding="utf-8"))
    doc["checks"][KEY].update({"value": 2, "for": "2s"})
    path = directory / "thresholds.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


class _SlowedSink:
    """The exporter's own sink, each apply slowed while ``slow`` is set."""

    def __init__(self, inner: Any, slow: threading.Event) -> None:
        self._inner, self._slow = inner, slow

    def apply_kv_batch(self, batch: Any, received_at: float) -> None:
        if self._slow.is_set():
            time.sleep(SLOW_APPLY_S)
        self._inner.apply_kv_batch(batch, received_at)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _check(url: str) -> dict:
    body = requests.get(url + "/api/v1/groups", timeout=10).json()["data"]
    return next(c for s in body["steps"] for c in s["checks"] if c["key"] == KEY)


def _sample(url: str, name: str, **labels: str) -> float | None:
    """One sample of the exporter's /metrics, by name and labels (worker w0 unless told)."""
    want = {"worker": "w0", **labels}
    for m in re.finditer(rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$", requests.get(url + "/metrics", timeout=10).text, re.M):
        if dict(re.findall(r'(\w+)="([^"]*)"', m[1])) == want:
            return float(m[2])
    return None


def test_an_exporter_that_falls_behind_alerts_sheds_into_the_replay_and_clears_once_caught_up(tmp_path: Path) -> None:
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, TOPIC], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert worker.stdin is not None and worker.stdout is not None
    published = 0

    def publish(n: int) -> int:
        nonlocal published
        worker.stdin.write(f"burst {n}\n")  # type: ignore[union-attr]
        worker.stdin.flush()  # type: ignore[union-attr]
        published = int(worker.stdout.readline())  # type: ignore[union-attr]
        return published

    pub_ep, replay_ep = worker.stdout.readline().split()
    cfg = Config(listen_address="127.0.0.1:0", breach_interval=0.2, thresholds=_thresholds(tmp_path),
                 workers=(WorkerTarget(name="w0", kv_events=pub_ep, replay=replay_ep, topic=TOPIC),))
    runtime = Runtime.build(cfg)
    assert runtime.subscriber is not None
    slow = threading.Event()
    runtime.subscriber.sink = _SlowedSink(runtime.subscriber.sink, slow)
    runtime.start()
    url = runtime.url
    try:
        assert runtime.subscriber.wait_started(30)
        # Keeping up: a few batches, each read as soon as it is sent.
        for _ in range(5):
            publish(1)
        wait_for(lambda: _sample(url, "prefixscope_kv_event_batches_total") == published, "the first batches",
                 timeout=60)
        assert _check(url)["status"] == "ok"

        # Short of CPU, the worker bursts: the exporter says it is behind, and sheds what does not fit.
        slow.set()
        publish(BURST)
        behind = wait_for(lambda: (c := _check(url))["alert_state"] == "firing" and c, "the lag alert to fire",
                          timeout=300, every=0.2)
        assert behind["status"] == "firing" and behind["value"] > 2.0
        assert _sample(url, "prefixscope_kv_event_lag_seconds") > 2.0

        # CPU back, and the worker quiet: the exporter reads what waited, then nothing of the worker
        # waits, so its lag reads 0 although no batch came since, and the alert clears.
        slow.clear()
        cleared = wait_for(lambda: (c := _check(url))["status"] == "ok" and c["alert_state"] == "inactive" and c,
                           "the lag alert to clear", timeout=300, every=0.2)
        assert cleared["value"] == 0.0 and _sample(url, "prefixscope_kv_event_lag_seconds") == 0.0

        # The next batches show the gap; the replay fetches what was shed. Its batches are old by the time
        # they are applied, yet once applied nothing waits: no lag is left behind.
        def healed() -> bool:
            publish(1)
            recovered = _sample(url, "prefixscope_kv_event_replays_total", result="recovered")
            gaps = _sample(url, "prefixscope_kv_event_sequence_gaps_total")
            applied = _sample(url, "prefixscope_kv_event_batches_total")
            return bool(gaps) and recovered == gaps and applied is not None and applied >= published

        wait_for(healed, "the gap to be replayed", timeout=300, every=0.5)
        after = wait_for(lambda: (c := _check(url))["status"] == "ok" and c, "the lag after the replay", timeout=300)
        assert after["value"] < 1.0
        missed = _sample(url, "prefixscope_kv_event_missed_batches_total")
        lost = _sample(url, "prefixscope_kv_event_lost_batches_total")
    finally:
        slow.clear()
        runtime.stop()
        worker.kill()
        worker.wait()
    # Most of the burst never queued in the exporter: the receive queue (1,000 messages for one worker),
    # the worker's send queue (200) and the sockets' buffers hold a fraction of it; the rest was shed as
    # a gap, which the replay healed: nothing lost.
    assert missed is not None and missed >= BURST // 3, missed
    assert lost == 0
