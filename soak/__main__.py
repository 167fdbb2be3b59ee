"""``python -m soak`` (``make soak``): the exporter under healthy load and hostile peers, for minutes.

Runs, all on 127.0.0.1:

- the simulated fleet (``prefixscope sim --speed 10``: KV events, worker /metrics and request
  records at ten times the scenario's real rate), posting its records to the exporter;
- the exporter, from a config with the fleet's manifest, a bearer token and bounded limits;
- the scale-out path beside it: ``prefixscope relay`` publishing the same workers' KV events to a
  real nats-server's JetStream, and two family shards (``prefixscope export`` with ``shard:``)
  reading the stream;
- OTLP traffic: vLLM's ``llm_request`` spans POSTed to ``/v1/traces``;
- hostile peers: more slow-loris connections dripping their headers than ``web.max_connections``
  admits, clients that announce large bodies and stall half-way, bodies of bad records (lone
  surrogates, deep nesting, huge and float integers) and records naming a new model, segment and
  worker each time;
- chaos: one shard is SIGKILLed and restarted (it rebuilds from the stream), and nats-server is
  killed and restarted on its store (the relay retries, the shards resume);
- a scraper that GETs /metrics every second, like Prometheus.

Every ``--sample`` seconds it records the exporter's RSS, the /metrics latency, the series
count, the KV-event lag and the records ingested, and at the end prints them with a verdict:
RSS flat over the last third, every scrape
answered 200 in under a second, records, spans and KV events kept flowing. At the end the fleet is
paused (SIGSTOP) and the shards' resident blocks, summed per worker, must equal the exporter's
(which reads the workers directly): no block lost through the shard kill or the NATS restart, and
no batch lost for good anywhere. Exit status 1 when a verdict fails.

The first two thirds of a run fill what configuration bounds (sessions up to ``limits.sessions``,
the windows, the prefix index up to the workers' capacity); RSS must be flat over the last
third (its last samples' mean within ``--rss-growth`` of its first samples' mean).

The index is bounded by the workers' KV capacity, and at 10× the packaged fleet's caches
(64,000 blocks a worker) take longer than a 10-minute run to fill: RSS would still be growing
towards that bound, legitimately. So the fleet runs the packaged topology with caches
``--cache-scale`` times its size (default 1/8, and for a run shorter than five minutes in
proportion less: ``--minutes 1`` is the quickest green run), full within the first minutes, and the verdict
also requires the index to be full (resident ≥ 90 % of capacity) over the last third. Likewise
the hit history (an hour of hits by default, ``limits.hit_history`` of them at most) is capped at
20,000 hits, which the fleet's records fill in the first minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests

HOST = "127.0.0.1"
TOKEN = "soak-token"
MAX_CONNECTIONS = 64
SLOW_CLIENTS = MAX_CONNECTIONS + 36  # more than the exporter admits at once
SHARDS = 2
SCRAPE_LIMIT_S = 1.0
REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def metric_sum(text: str, name: str) -> float | None:
    vals = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(vals) if vals else None


def metric_max(text: str, name: str) -> float | None:
    vals = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return max(vals) if vals else None


@dataclass
class Stats:
    """What the peers saw, updated from their threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: dict[str, int] = field(default_factory=dict)
    scrape_s: list[float] = field(default_factory=list)

    def inc(self, key: str) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + 1


# ---- hostile peers --------------------------------------------------------------------------------
def slow_loris(port: int, stop: threading.Event, stats: Stats, conns: int = SLOW_CLIENTS) -> None:
    """Keep ``conns`` connections dripping a header byte every second; reopen the dropped ones."""
    socks: list[socket.socket] = []
    while not stop.is_set():
        while len(socks) < conns and not stop.is_set():
            try:
                s = socket.create_connection((HOST, port), timeout=2)
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
                socks.append(s)
                stats.inc("loris_opened")
            except OSError:
                stats.inc("loris_refused")
                break
        for s in list(socks):
            try:
                s.sendall(b"X")
            except OSError:
                socks.remove(s)
                s.close()
                stats.inc("loris_dropped")
        stop.wait(1.0)
    for s in socks:
        s.close()


def half_bodies(port: int, stop: threading.Event, stats: Stats) -> None:
    """Announce an 8 MB body, send half of a megabyte, stall; then again."""
    chunk = b"x" * 65536
    while not stop.is_set():
        try:
            with socket.create_connection((HOST, port), timeout=30) as s:
                s.sendall(b"POST /api/v1/records HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                          + TOKEN.encode() + b"\r\nContent-Length: 8000000\r\n\r\n")
                for _ in range(8):
                    s.sendall(chunk)
                s.settimeout(60)
                answer = s.recv(100)
                stats.inc("half_body_" + (answer[9:12].decode() if answer else "closed"))
        except OSError:
            stats.inc("half_body_error")
        stop.wait(0.5)


def bad_records(url: str, stop: threading.Event, stats: Stats) -> None:
    """Bodies mixing good records with every kind of bad one, and ever-new label values."""
    rng = random.Random(1)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    n = 0
    while not stop.is_set():
        now = time.time()
        good = [{"ts": now, "request_id": f"hostile-{n}-{i}", "worker": f"ghost-{n}-{i}", "prompt_tokens": 10,
                 "model": f"model-{n}-{i}", "segment": f"seg-{n}-{i}", "session_key": f"hs-{n}-{i}",
                 "block_hashes": [rng.getrandbits(63) for _ in range(64)]} for i in range(20)]
        lines = [json.dumps(r) for r in good]
        lines += [json.dumps({**good[0], "model": "\ud800"}), '{"a":' * 3000 + "1" + "}" * 3000,
                  json.dumps({**good[0], "prompt_tokens": 10**300}), json.dumps({**good[0], "cached_tokens": 16.0}),
                  "{not json"]
        try:
            r = requests.post(url, data="\n".join(lines).encode(), headers=auth, timeout=30)
            stats.inc(f"bad_records_{r.status_code}")
        except requests.RequestException:
            stats.inc("bad_records_error")
        n += 1
        stop.wait(0.2)


def otlp_spans(url: str, stop: threading.Event, stats: Stats) -> None:
    """vLLM's ``llm_request`` spans (OTLP/HTTP JSON), twenty a request, from eight span sources."""
    auth = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    n = 0

    def attrs(d: dict[str, object]) -> list[dict[str, object]]:
        return [{"key": k, "value": {"intValue": str(v)} if isinstance(v, int) else
                 {"doubleValue": v} if isinstance(v, float) else {"stringValue": v}} for k, v in d.items()]
    while not stop.is_set():
        end = time.time_ns()
        spans = [{"traceId": f"{n:016x}{i:016x}", "spanId": f"{n % 65536:08x}{i:08x}", "name": "llm_request",
                  "startTimeUnixNano": str(end - 900_000_000), "endTimeUnixNano": str(end),
                  "attributes": attrs({"gen_ai.usage.prompt_tokens": 200 + i, "gen_ai.usage.completion_tokens": 20,
                                       "gen_ai.response.model": "otlp-model",
                                       "gen_ai.latency.time_to_first_token": 0.05 + i / 1000})}
                 for i in range(20)]
        body = {"resourceSpans": [{"resource": {"attributes": attrs({"service.instance.id": f"otlp-{n % 8}"})},
                                   "scopeSpans": [{"spans": spans}]}]}
        try:
            r = requests.post(url, data=json.dumps(body).encode(), headers=auth, timeout=30)
            stats.inc(f"otlp_{r.status_code}")
        except requests.RequestException:
            stats.inc("otlp_error")
        n += 1
        stop.wait(0.2)


def scraper(url: str, stop: threading.Event, stats: Stats) -> None:
    while not stop.is_set():
        started = time.monotonic()
        try:
            r = requests.get(url + "/metrics", timeout=30)
            stats.inc(f"scrape_{r.status_code}")
            with stats.lock:
                stats.scrape_s.append(time.monotonic() - started)
        except requests.RequestException:
            stats.inc("scrape_error")
        stop.wait(1.0)


# ---- the run --------------------------------------------------------------------------------------
def prefixscope(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefixscope", *args]


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise SystemExit(f"soak: {what} did not happen within {timeout:g}s")
        time.sleep(0.2)


def healthy(url: str) -> bool:
    try:
        return requests.get(url + "/healthz", timeout=2).status_code == 200
    except requests.RequestException:
        return False


class Child:
    """A process the soak starts, may kill and restart, and stops; its output goes to ``<run>/<name>.log``."""

    def __init__(self, name: str, argv: list[str], run: Path, env: dict[str, str]) -> None:
        self.name, self.argv, self.run, self.env = name, argv, run, env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Child:
        with open(self.run / f"{self.name}.log", "ab") as log:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL: no shutdown, no final acknowledgement."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)  # a paused process handles SIGTERM only once resumed
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex((HOST, port)) == 0


def chaos(run_s: float, shard: Child, nats: Child, stop: threading.Event, stats: Stats) -> None:
    """A third of the way in, SIGKILL a shard and restart it; past the middle, kill nats-server and
    restart it on its store. Each is down a few seconds while traffic goes on."""
    t0 = time.monotonic()
    for at, child, what in ((0.35, shard, "shard"), (0.6, nats, "nats")):
        if stop.wait(max(0.0, t0 + at * run_s - time.monotonic())):
            return
        child.kill()
        stats.inc(f"{what}_killed")
        if stop.wait(3.0):
            return
        child.start()
        stats.inc(f"{what}_restarted")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m soak", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default %(default)s)")
    p.add_argument("--sample", type=float, default=10.0, help="seconds between samples (default %(default)s)")
    p.add_argument("--speed", type=float, default=10.0, help="the fleet's clock multiplier (default %(default)s)")
    p.add_argument("--cache-scale", type=float, default=None,
                   help=f"the workers' KV capacity as a share of the packaged topology's (default {CACHE_SCALE:g}, "
                        f"less for runs shorter than {FULL_SCALE_MINUTES:g} minutes)")
    p.add_argument("--rss-growth", type=float, default=0.10,
                   help="allowed RSS growth over the last third of the run (default %(default)s)")
    args = p.parse_args(argv)
    if args.cache_scale is None:
        args.cache_scale = cache_scale(args.minutes)
    nats_bin = shutil.which("nats-server")
    if nats_bin is None:
        print("soak: needs nats-server for the relay and the shards (make system-packages installs it)")
        return 1

    run = Path(tempfile.mkdtemp(prefix="prefixscope-soak-"))
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    port = free_port()
    url = f"http://{HOST}:{port}"
    manifest = run / "fleet.json"
    children: list[Child] = []
    stop = threading.Event()
    try:
        topology = run / "topology.yaml"
        topology.write_text(scaled_topology(args.cache_scale), encoding="utf-8")
        sim = Child("sim", prefixscope("sim", "--topology", str(topology), "--manifest", str(manifest), "--repeat",
                                       "--speed", str(args.speed), "--records-url", f"{url}/api/v1/records",
                                       "--records-token", TOKEN), run, env).start()
        children.append(sim)
        wait_for(manifest.exists, 90, "the simulated fleet starting")
        nats_port = free_port()
        nats_url = f"nats://{HOST}:{nats_port}"
        nats = Child("nats", [nats_bin, "-js", "-sd", str(run / "js"), "-p", str(nats_port), "-a", HOST], run,
                     env).start()
        children.append(nats)
        wait_for(lambda: listening(nats_port), 30, "nats-server listening")
        relay_cfg = run / "relay.yaml"
        relay_cfg.write_text(json.dumps({"nats": {"url": nats_url}, "fleet_manifest": str(manifest),
                                         "retention": {"max_age": "6h", "max_bytes": 4 << 30}}))
        children.append(Child("relay", prefixscope("relay", "--config.file", str(relay_cfg), "--log.level", "warning"),
                              run, env).start())
        cfg = run / "exporter.yaml"
        cfg.write_text(json.dumps({
            "fleet_manifest": str(manifest), "scrape_interval": "1s", "scrape_timeout": "1s",
            "records": {"http": {"bearer_token": TOKEN}},
            "limits": {"models": 50, "segments": 50, "workers": 200, "label_idle": "5m", "sessions": 5000,
                       "hit_history": 20000},
            "web": {"max_connections": MAX_CONNECTIONS, "read_timeout": "5s"},
        }))
        exporter = Child("exporter", prefixscope("export", "--config.file", str(cfg), "--web.listen-address",
                                                 f"{HOST}:{port}", "--log.level", "warning"), run, env).start()
        children.append(exporter)
        shard_urls, shards = [], []
        for i in range(SHARDS):
            shard_port = free_port()
            shard_cfg = run / f"shard{i}.yaml"
            shard_cfg.write_text(json.dumps({
                "kv_nats": {"url": nats_url, "all_workers": True, "durable": f"soak-shard{i}"},
                "shard": {"index": i, "count": SHARDS}, "records": {"http": {"enabled": False}},
                "otlp": {"enabled": False}}))
            shards.append(Child(f"shard{i}", prefixscope("export", "--config.file", str(shard_cfg),
                                                         "--web.listen-address", f"{HOST}:{shard_port}",
                                                         "--log.level", "warning"), run, env).start())
            shard_urls.append(f"http://{HOST}:{shard_port}")
        children += shards
        for u in [url, *shard_urls]:
            wait_for(lambda u=u: healthy(u), 60, f"{u} answering /healthz")
        print(f"soak: {args.minutes:g} min, fleet at {args.speed:g}x, exporter pid {exporter.pid} on {url}, "
              f"{SHARDS} shards through nats-server; logs in {run}", flush=True)

        stats = Stats()
        peers = [threading.Thread(target=fn, args=a, daemon=True) for fn, a in (
            (slow_loris, (port, stop, stats)), (half_bodies, (port, stop, stats)),
            (bad_records, (f"{url}/api/v1/records", stop, stats)), (otlp_spans, (f"{url}/v1/traces", stop, stats)),
            (scraper, (url, stop, stats)), (chaos, (args.minutes * 60, shards[-1], nats, stop, stats)))]
        for t in peers:
            t.start()

        samples: list[dict[str, float | None]] = []
        end = time.monotonic() + args.minutes * 60
        header = (f"{'t(s)':>6} {'RSS MB':>8} {'scrape s':>9} {'series':>8} {'KV lag s':>9} {'records':>10} "
                  f"{'index':>6} {'health':>7}")
        print(header, flush=True)
        t0 = time.monotonic()
        while time.monotonic() < end:
            time.sleep(min(args.sample, max(0.0, end - time.monotonic())))
            if not exporter.alive():
                print(f"soak: the exporter exited; see {run / 'exporter.log'}")
                return 1
            started = time.monotonic()
            try:
                text = requests.get(url + "/metrics", timeout=30).text
            except requests.RequestException as exc:
                print(f"soak: sample scrape failed: {exc}")
                continue
            took = time.monotonic() - started
            sample = {
                "t": time.monotonic() - t0, "rss": rss_bytes(exporter.pid), "scrape_s": took,
                "series": float(sum(1 for ln in text.splitlines() if ln and not ln.startswith("#"))),
                "kv_lag": metric_max(text, "prefixscope_kv_event_lag_seconds"),
                "records": metric_sum(text, "prefixscope_records_ingested_total"),
                "healthz": 1.0 if healthy(url) else 0.0,
                "index_fill": index_fill(text),
            }
            samples.append(sample)
            lag = sample["kv_lag"]
            print(f"{sample['t']:6.0f} {sample['rss'] / 2**20:8.1f} {took:9.3f} {sample['series']:8.0f} "
                  f"{'-' if lag is None else f'{lag:.3f}':>9} {sample['records'] or 0:10.0f} "
                  f"{sample['index_fill'] or 0:6.0%} {'ok' if sample['healthz'] else 'FAIL':>7}", flush=True)
        stop.set()
        lost = lost_blocks(sim, url, shard_urls)
        return report(samples, stats, args.rss_growth, lost)
    finally:
        stop.set()
        for child in reversed(children):
            child.stop()


@dataclass
class Lost:
    """The end-of-run comparison: the shards' resident blocks per worker against the exporter's."""

    equal: bool
    workers: int
    blocks: float
    differing: dict[str, tuple[float, float]]
    lost_batches: float


def resident_by_worker(text: str) -> dict[str, float]:
    return {m[1]: float(m[2]) for m in re.finditer(r'^prefixscope_worker_resident_blocks\{worker="([^"]*)"\} (\S+)$',
                                                   text, re.M) if float(m[2])}


def lost_blocks(sim: Child, url: str, shard_urls: list[str], timeout: float = 120.0) -> Lost:
    """Pause the fleet (SIGSTOP: nothing more is stored or evicted), let the exporter and the
    shards drain what was published, and compare: the shards' parts of each worker's resident
    blocks must add up to what the exporter holds from the workers directly."""
    os.kill(sim.pid, signal.SIGSTOP)
    try:
        deadline, last, streak = time.monotonic() + timeout, None, 0
        while True:
            try:
                texts = [requests.get(u + "/metrics", timeout=30).text for u in [url, *shard_urls]]
            except requests.RequestException:
                texts = []
            if texts:
                one = resident_by_worker(texts[0])
                summed: dict[str, float] = {}
                for t in texts[1:]:
                    for w, n in resident_by_worker(t).items():
                        summed[w] = summed.get(w, 0.0) + n
                lost = sum(metric_sum(t, "prefixscope_kv_event_lost_batches_total") or 0.0 for t in texts)
                differing = {w: (one.get(w, 0.0), summed.get(w, 0.0)) for w in one.keys() | summed.keys()
                             if one.get(w, 0.0) != summed.get(w, 0.0)}
                now = (bool(one) and not differing, len(one), sum(one.values()), differing, lost)
                streak = streak + 1 if now[0] and now[:3] == (last or (None,) * 3)[:3] else (1 if now[0] else 0)
                last = now
                if streak >= 3 or time.monotonic() > deadline:  # equal and still for three readings
                    return Lost(*now)
            time.sleep(1.0)
    finally:
        os.kill(sim.pid, signal.SIGCONT)


FULL = 0.9  # resident/capacity over the fleet at which the index has reached its bound
CACHE_SCALE = 0.125
FULL_SCALE_MINUTES = 5.0


def cache_scale(minutes: float) -> float:
    """The caches' scale for a run: 1/8 of the packaged topology's, in proportion less for a run
    shorter than five minutes, so the index still reaches its bound within the run's first two thirds."""
    return CACHE_SCALE * min(1.0, minutes / FULL_SCALE_MINUTES)


def index_fill(text: str) -> float | None:
    """Resident blocks over capacity, summed over the workers (the index's bound is their capacity)."""
    resident = metric_sum(text, "prefixscope_worker_resident_blocks")
    capacity = metric_sum(text, "prefixscope_worker_capacity_blocks")
    return resident / capacity if resident is not None and capacity else None


def scaled_topology(scale: float) -> str:
    """The packaged topology with every GPU class's KV capacity scaled (at least 1,000 blocks)."""
    import yaml

    from fleet.topology import DEFAULT_TOPOLOGY

    data = yaml.safe_load(Path(DEFAULT_TOPOLOGY).read_text(encoding="utf-8"))
    for gpu in data["gpu_classes"].values():
        gpu["kv_blocks"] = max(1000, int(gpu["kv_blocks"] * scale))
    return yaml.safe_dump(data, sort_keys=False)


def report(samples: list[dict[str, float | None]], stats: Stats, allowed_growth: float, lost: Lost) -> int:
    if len(samples) < 3:
        print("soak: too few samples for a verdict (run longer)")
        return 1
    third = len(samples) // 3
    # The first two thirds fill what is bounded by configuration (sessions, windows, the index up
    # to the workers' capacity); over the last third RSS must stay flat.
    last = [float(s["rss"] or 0) for s in samples[2 * third:]]
    head, tail = last[: max(1, len(last) // 3)], last[-max(1, len(last) // 3):]
    growth = (sum(tail) / len(tail)) / (sum(head) / len(head)) - 1
    with stats.lock:
        counts = dict(sorted(stats.counts.items()))
        lat = sorted(stats.scrape_s)
    p50 = lat[len(lat) // 2] if lat else float("nan")
    p99 = lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else float("nan")
    records = [s["records"] or 0 for s in samples]
    lags = [s["kv_lag"] for s in samples if s["kv_lag"] is not None]
    fills = [float(s["index_fill"] or 0) for s in samples[2 * third:]]
    verdicts = {
        f"the index at its bound over the last third (resident/capacity ≥ {FULL:.0%}: "
        f"{min(fills):.0%}–{max(fills):.0%})": min(fills) >= FULL,
        f"RSS flat over the last third ({growth:+.1%}, allowed {allowed_growth:+.0%}; "
        f"{min(last) / 2**20:.0f}–{max(last) / 2**20:.0f} MB)": growth <= allowed_growth,
        f"every scrape answered 200 ({counts.get('scrape_200', 0)} scrapes, p50 {p50:.3f}s, p99 {p99:.3f}s)":
            not any(k.startswith("scrape_") and k != "scrape_200" for k in counts),
        f"records kept flowing ({records[0]:.0f} → {records[-1]:.0f})": records[-1] > records[third],
        f"/healthz ok in every sample ({sum(1 for s in samples if s['healthz'])}/{len(samples)})":
            all(s["healthz"] for s in samples),
        f"KV lag bounded (max {max(lags) if lags else float('nan'):.3f}s)": bool(lags) and max(lags) < 5.0,
        f"series bounded ({samples[third]['series']:.0f} → {samples[-1]['series']:.0f})":
            float(samples[-1]["series"] or 0) <= 1.2 * float(samples[third]["series"] or 0) + 200,
        f"every scrape under {SCRAPE_LIMIT_S:g} s with {SLOW_CLIENTS} slow clients against "
        f"web.max_connections {MAX_CONNECTIONS} (max {lat[-1] if lat else float('nan'):.3f}s; slow clients opened "
        f"{counts.get('loris_opened', 0)}, refused {counts.get('loris_refused', 0)})":
            bool(lat) and lat[-1] < SCRAPE_LIMIT_S,
        f"OTLP spans accepted ({counts.get('otlp_200', 0)} exports of 20)":
            counts.get("otlp_200", 0) > 0 and not any(k.startswith("otlp_") and k != "otlp_200" for k in counts),
        f"a shard killed and restarted, nats-server killed and restarted ({counts.get('shard_restarted', 0)}, "
        f"{counts.get('nats_restarted', 0)})": counts.get("shard_restarted", 0) >= 1 and counts.get("nats_restarted", 0) >= 1,
        f"zero lost blocks: the shards' resident blocks equal the exporter's for {lost.workers} workers "
        f"({lost.blocks:.0f} blocks; differing: {dict(sorted(lost.differing.items())[:5])}), "
        f"batches lost for good {lost.lost_batches:.0f}": lost.equal and lost.lost_batches == 0,
    }
    print("\nhostile peers:", ", ".join(f"{k}={v}" for k, v in counts.items()))
    for what, ok in verdicts.items():
        print(f"{'PASS' if ok else 'FAIL'}  {what}")
    return 0 if all(verdicts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
