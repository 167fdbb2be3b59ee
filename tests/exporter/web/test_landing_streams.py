"""The landing page reports each KV-event stream as the exporter sees it, not "not yet scraped".

A real exporter (``Runtime``) subscribed to three workers' streams: one has just sent a batch,
one sent its last long ago, one has sent nothing.
"""

from __future__ import annotations

import time

import requests

from exporter.config import Config, WorkerTarget
from exporter.main import Runtime
from exporter.model import BlockStored, KvBatch
from tests.support import free_port


def test_kv_streams_read_streaming_stale_or_silent() -> None:
    workers = tuple(WorkerTarget(name, kv_events=f"tcp://127.0.0.1:{free_port()}") for name in ("w0", "w1", "w2"))
    runtime = Runtime.build(Config(listen_address="127.0.0.1:0", workers=workers)).start()
    try:
        now = time.time()
        runtime.state.apply_kv_batch(KvBatch("w0", 0, now, (BlockStored((1,), None, 16),)), now)
        runtime.state.apply_kv_batch(KvBatch("w1", 0, now - 600, (BlockStored((2,), None, 16),)), now - 600)
        page = requests.get(runtime.url + "/", timeout=5).text
    finally:
        runtime.stop()
    rows = {line.split("</td>")[0].removeprefix("<tr><td>"): line for line in page.split("</tr>")
            if "<td>kv_events</td>" in line}
    assert "streaming: last KV event just now" in rows["w0"] or "streaming: last KV event 1 s ago" in rows["w0"]
    assert "<b>stale: last KV event 10 m" in rows["w1"]
    assert "subscribed, no KV event received yet" in rows["w2"]
    assert "not yet scraped" not in "".join(rows.values())
