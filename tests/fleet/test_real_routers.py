"""Real sglang-router and vllm-router in front of simulated workers keep prefix groups together.

Both routers come from PyPI into the `.routers` venv. As observed with both (routers reference
§4), sequential requests to idle workers all land on the first worker, so the first request of
every group is sent concurrently to workers that take ~0.3 s, and the test asserts per-group
stickiness and that more than one worker is used, not a fixed mapping.
"""

from __future__ import annotations

import pytest
import requests

from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from tests.e2e.routers import drive, start_router

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet():
    # decode 16 tokens at 50/s ≈ 0.3 s per request on the real clock
    specs = [WorkerSpec(f"w{i}", decode_tps=50.0) for i in range(3)]
    with WorkerFleet(specs, options=FleetOptions(delay_scale=1.0)) as f:
        yield f


def assert_affinity(placed: dict[int, list[str]], cached: list[int]) -> None:
    for g, workers in placed.items():
        assert len(set(workers)) == 1, f"group {g} was split: {workers}"
    assert len({ws[0] for ws in placed.values()}) > 1, f"every group on one worker: {dict(placed)}"
    # follow-ups found their group's prefix in the worker's cache
    assert min(cached) >= 16 * 30


def test_sglang_router_cache_aware_keeps_groups_on_one_worker(fleet, routers_bin, tmp_path):
    router = start_router("sglang-router", routers_bin, fleet.urls, tmp_path)
    try:
        placed, cached = drive(router.url, "completions")
        assert_affinity(placed, cached)
        text = requests.get(router.metrics_url, timeout=5).text
        assert "smg_worker_cb_outcomes_total" in text
    finally:
        router.stop()


def test_vllm_router_cache_aware_uses_render_and_keeps_groups_on_one_worker(fleet, routers_bin, tmp_path):
    router = start_router("vllm-router", routers_bin, fleet.urls, tmp_path)
    try:
        placed, cached = drive(router.url, "chat")
        assert_affinity(placed, cached)
        text = requests.get(router.metrics_url, timeout=5).text
        assert 'outcome="prefix_hit"' in text
        assert 'result="render"' in text  # prefix inputs came from our render endpoint
    finally:
        router.stop()
