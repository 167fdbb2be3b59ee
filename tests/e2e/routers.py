"""Start and stop the real sglang-router and vllm-router (from the `.routers` venv), and the SGLang
model gateway (smg, from its `.peers` venv), on 127.0.0.1.

Both routers are unmodified PyPI wheels. Each gets its own main and metrics port (both default
to 29000 for metrics, and sglang-router binds 0.0.0.0 unless told otherwise). sglang-router
opens its port at once and registers workers in the background, so readiness is polled until
every worker is healthy; vllm-router blocks until its workers answer /health, checked every
``--worker-startup-check-interval`` seconds (30 by default, 1 here).
"""

from __future__ import annotations

import subprocess
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import requests

from fleet.worker_http import WORKER_HEADER
from tests.support import free_port

KINDS = ("sglang-router", "vllm-router")
SMG = "smg"  # the SGLang model gateway 1.13 (its own venv, .peers/smg-VERSION); read by the sglang-router adapter
# The endpoint each router is driven through: vllm-router's prefix matching needs the worker's
# render endpoint, which the simulated workers answer for chat.
ENDPOINT = {"sglang-router": "completions", "vllm-router": "chat"}
TOPICS = ("databases", "compilers", "gardening", "astronomy", "cooking")


@dataclass
class RouterProcess:
    kind: str
    proc: subprocess.Popen
    port: int
    metrics_port: int
    log_path: Path
    log: IO[bytes]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, chars: int = 2000) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)  # smg drains for a few seconds after SIGTERM
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()


def router_command(kind: str, bin_dir: Path, worker_urls: Sequence[str], port: int, metrics_port: int, *,
                   policy: str = "cache_aware", health_interval_s: int | None = None,
                   extra_args: Sequence[str] = ()) -> list[str]:
    """The command line of one router; ``health_interval_s`` turns on fast runtime health checks,
    ``extra_args`` go last (e.g. sglang-router's ``--enable-trace --otlp-traces-endpoint H:P``)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(metrics_port), "--worker-urls", *worker_urls, "--policy", policy]
    if health_interval_s is not None:
        common += ["--health-check-interval-secs", str(health_interval_s), "--health-failure-threshold", "1",
                   "--health-check-timeout-secs", "1"]
    if kind == "sglang-router":
        return [str(bin_dir / "python"), "-m", "sglang_router.launch_router", *common, "--log-level", "warn",
                *extra_args]
    if kind == "vllm-router":
        return [str(bin_dir / "vllm-router"), *common, "--worker-startup-check-interval", "1", "--log-level", "warning",
                *extra_args]
    if kind == SMG:
        return [str(bin_dir / "smg"), "launch", *common, "--log-level", "warn", *extra_args]
    raise ValueError(f"unknown router kind {kind!r}; choose one of {', '.join(KINDS)}")


def _ready(kind: str, workers: int) -> Callable[[requests.Response], bool]:
    if kind in ("sglang-router", SMG):  # the port opens before the workers are registered
        return lambda r: r.status_code == 200 and r.json().get("healthy_workers") == workers
    return lambda r: r.status_code == 200


def start_router(kind: str, bin_dir: Path, worker_urls: Sequence[str], log_dir: Path, *,
                 policy: str = "cache_aware", health_interval_s: int | None = None,
                 extra_args: Sequence[str] = (), timeout: float = 30.0) -> RouterProcess:
    """Start one router in front of ``worker_urls`` and wait until it routes to all of them."""
    port, metrics_port = free_port(), free_port()
    cmd = router_command(kind, bin_dir, worker_urls, port, metrics_port, policy=policy,
                         health_interval_s=health_interval_s, extra_args=extra_args)
    log_path = log_dir / f"{kind}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - closed by RouterProcess.stop
    router = RouterProcess(kind, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT),
                           port, metrics_port, log_path, log)
    ready = _ready(kind, len(worker_urls))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and router.proc.poll() is None:
        try:
            if ready(requests.get(router.url + "/readiness", timeout=1)):
                return router
        except requests.RequestException:
            pass
        time.sleep(0.2)
    tail = router.log_tail()
    router.stop()
    raise AssertionError(f"{kind} did not become ready within {timeout:g}s: {tail}")


# ---- load with shared prefixes ----------------------------------------------------------------
def post(base: str, endpoint: str, group: int, i: int, model: str = "sim-model",
         headers: Mapping[str, str] | None = None) -> requests.Response:
    """Request ``i`` of prefix group ``group``: the group's long shared prefix, then a question."""
    prefix = f"You are an expert assistant on {TOPICS[group]}. " * 12
    question = f"Question {i}: what matters most about {TOPICS[group]} when item {i} is involved?"
    if endpoint == "chat":
        return requests.post(f"{base}/v1/chat/completions", timeout=30, headers=headers, json={
            "model": model, "max_tokens": 16,
            "messages": [{"role": "system", "content": prefix}, {"role": "user", "content": question}]})
    return requests.post(f"{base}/v1/completions", timeout=30, headers=headers,
                         json={"model": model, "prompt": prefix + question, "max_tokens": 16})


def ask(base: str, endpoint: str, group: int, i: int, model: str = "sim-model") -> tuple[int, str, int]:
    """One request of prefix group ``group`` → (group, serving worker, engine-reported cached tokens)."""
    r = post(base, endpoint, group, i, model)
    assert r.status_code == 200, r.text
    return group, r.headers[WORKER_HEADER], r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def drive(base: str, endpoint: str, groups: int = 5, per_group: int = 5,
          in_flight: int = 4) -> tuple[dict[int, list[str]], list[int]]:
    """Prefix groups through a router → (workers per group in order, cached tokens of follow-ups).

    Both routers send every new prefix to the first idle worker when requests arrive one at a
    time, so the first request of every group goes out at once; the rest follow concurrently.
    """
    placed: dict[int, list[str]] = defaultdict(list)
    cached: list[int] = []
    with ThreadPoolExecutor(groups) as pool:
        for g, w, _ in pool.map(lambda g: ask(base, endpoint, g, 0), range(groups)):
            placed[g].append(w)
    rest = [(g, i) for i in range(1, per_group) for g in range(groups)]
    with ThreadPoolExecutor(in_flight) as pool:
        for g, w, c in pool.map(lambda gi: ask(base, endpoint, *gi), rest):
            placed[g].append(w)
            cached.append(c)
    return placed, cached
