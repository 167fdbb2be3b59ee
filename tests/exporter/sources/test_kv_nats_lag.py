"""A worker fed over NATS that goes quiet after a backlog reads lag 0, not the backlog's lag forever.

The lag is a batch's age when it is applied; before, only the ZMQ subscriber set it back once
nothing waited, so a worker whose last relayed or Dynamo message came late kept that lag (and its
``PrefixTelemetryKvIngestLagging`` alert) while it published nothing. A real nats-server on
127.0.0.1; batches as the relay writes them into the stream, and Dynamo's own messages.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.core.health import Health
from exporter.sources.kv_nats import NatsKvSettings, NatsKvSource
from exporter.sources.kv_zmq import LAG
from tests import servers
from tests.exporter.sources.test_kv_nats_judged import DYNAMO_SUBJECT, dynamo, payload, publish, relayed
from tests.support import wait_for

AGE_S = 30.0  # how old the backlog's batches are when the exporter reads them


class LagSink:
    """Sets each applied batch's lag as the exporter's state does, and keeps what it set."""

    def __init__(self, health: Health) -> None:
        self.health = health
        self.lags: list[float] = []

    def apply_kv_batch(self, batch, received_at) -> None:
        lag = max(0.0, received_at - batch.ts)
        self.lags.append(lag)
        self.health.set(LAG, (batch.worker,), lag)

    def worker_restarted(self, worker) -> None:
        pass


@pytest.fixture
def nats_url(tmp_path: Path) -> Iterator[str]:
    with servers.nats_server(tmp_path / "js") as url:
        yield url


def _lag(health: Health, worker: str) -> float | None:
    return health.snapshot()[1].get(LAG, {}).get((worker,))


def test_a_relayed_backlog_s_lag_reads_0_once_the_stream_is_read_to_its_end(nats_url: str) -> None:
    old = time.time() - AGE_S
    publish(nats_url, [relayed("w0", seq, payload(old + seq, seq + 1)) for seq in range(3)])
    health = Health()
    sink = LagSink(health)
    src = NatsKvSource(NatsKvSettings(url=nats_url), sink, health)
    src.start()
    try:
        assert src.wait_started(30)
        wait_for(lambda: len(sink.lags) == 3, what="the backlog applied")
        assert min(sink.lags) >= AGE_S - 5  # each was that late when applied
        wait_for(lambda: _lag(health, "w0") == 0.0, what="the lag back at 0 with nothing left to read")
    finally:
        src.close()


def test_a_late_dynamo_message_s_lag_reads_0_once_no_message_waits(nats_url: str) -> None:
    import nats

    health = Health()
    sink = LagSink(health)
    src = NatsKvSource(NatsKvSettings(url=nats_url, relay=False, dynamo_subjects=(DYNAMO_SUBJECT,)), sink, health)
    src.start()
    late = json.loads(dynamo("enveloped", 4, sequence=5))
    late["published_at_ns"] = int((time.time() - AGE_S) * 1e9)

    async def run() -> None:
        nc = await nats.connect(nats_url)
        await nc.publish(DYNAMO_SUBJECT, json.dumps(late).encode())
        await nc.flush()
        await nc.close()

    try:
        assert src.wait_started(30)
        asyncio.run(run())
        wait_for(lambda: sink.lags, what="the late message applied")
        assert sink.lags[0] >= AGE_S - 5
        wait_for(lambda: _lag(health, "11") == 0.0, what="the lag back at 0 with no message waiting")
    finally:
        src.close()
