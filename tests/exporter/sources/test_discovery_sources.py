"""Each discovery mechanism against the real thing on 127.0.0.1: an http_sd server, a Prometheus
server's targets API (Debian's prometheus, its own file_sd with meta labels), the worker lists of
the real sglang-router and vllm-router in front of simulated workers, Dynamo's instance
registry in a real etcd (Debian's etcd-server), and Kubernetes pods through the official client
against recorded API responses (no kube-apiserver runs here: see that section). Each is read through :class:`Discovery`, so the
relabelling, the worker set handed on, the failure accounting and the kept last-good set are what
is checked.
"""

from __future__ import annotations

import base64
import copy
import json
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import pytest
import requests
import yaml

from exporter.codecs.discovery import relabel
from exporter.config import SdProvider, WorkerTarget, parse_config
from exporter.core.health import Health
from exporter.sources.discovery.manager import Discovery
from fleet.engine import WorkerSpec
from fleet.workers import FleetOptions, WorkerFleet
from prefixscope.topology import with_discovered
from tests.e2e.routers import start_router
from tests.support import free_port, require_routers_bin, require_tool, wait_for


def follow(*providers: SdProvider, static: tuple[WorkerTarget, ...] = ()) -> tuple[Discovery, list, Health]:
    seen: list[tuple[WorkerTarget, ...]] = []
    health = Health()
    return Discovery(providers, static, seen.append, health), seen, health


def rules(*raw: dict) -> tuple[relabel.Rule, ...]:
    return tuple(relabel.rule(r) for r in raw)


# ---- http_sd -------------------------------------------------------------------------------
class _SdHandler(BaseHTTPRequestHandler):
    body: bytes = b"[]"
    status = 200
    headers_seen: ClassVar[list[dict]] = []

    def do_GET(self) -> None:
        type(self).headers_seen.append(dict(self.headers))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def http_sd() -> Iterator[tuple[str, type[_SdHandler]]]:
    handler = type("Handler", (_SdHandler,), {"headers_seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/sd", handler
    finally:
        server.shutdown()
        server.server_close()


def test_http_sd_follows_the_answer_and_keeps_the_last_good_one(http_sd: tuple[str, type[_SdHandler]]) -> None:
    url, handler = http_sd
    handler.body = json.dumps([{"targets": ["10.0.0.1:8000", "10.0.0.2:8000"],
                                "labels": {"__meta_role": "decode", "kv_events_port": "5557"}},
                               {"targets": ["10.0.0.3:8000"], "labels": {"__meta_role": "prefill"}}]).encode()
    static = (WorkerTarget("pinned", "http://127.0.0.1:1/metrics"),)
    d, seen, health = follow(SdProvider("http_sd", "sd", 60.0, url=url, relabel=rules(
        {"source_labels": ["__meta_role"], "regex": "decode", "action": "keep"})), static=static)
    d.refresh_once(force=True)
    assert [w.name for w in seen[-1]] == ["pinned", "10.0.0.1:8000", "10.0.0.2:8000"]
    assert seen[-1][1].kv_events == "tcp://10.0.0.1:5557"
    assert handler.headers_seen[-1]["X-Prometheus-Refresh-Interval-Seconds"] == "60"
    assert health.gauges["prefixscope_discovery_targets"][("sd",)] == 2

    handler.status, handler.body = 500, b"oops"
    assert d.refresh_once(force=True) is False  # the last good workers stay
    assert health.counters["prefixscope_discovery_refresh_failures"][("sd",)] == 1
    assert health.counters["prefixscope_ingest_errors"][("discovery", "http_status")] == 1

    handler.status, handler.body = 200, b'[{"targets": ["10.0.0.2:8000"], "labels": {"__meta_role": "decode"}}]'
    assert d.refresh_once(force=True) is True
    assert [w.name for w in seen[-1]] == ["pinned", "10.0.0.2:8000"]


def test_file_sd_reads_a_changed_file_and_keeps_a_broken_one(tmp_path: Path) -> None:
    f = tmp_path / "targets" / "fleet.yaml"
    f.parent.mkdir()
    f.write_text(yaml.safe_dump([{"targets": ["h:1"], "labels": {"worker": "a"}}]))
    d, seen, health = follow(SdProvider("file_sd", "files", 300.0, files=(str(tmp_path / "targets" / "*.yaml"),)))
    d.refresh_once(force=True)
    assert [w.name for w in seen[-1]] == ["a"]
    assert d.refresh_once() is False  # unchanged: not read again before the interval
    f.write_text("[{targets: [h:1, h:2], labels: {worker: a}}]\n- broken")
    assert d.refresh_once() is False  # broken: the file's last good targets stay
    assert health.counters["prefixscope_discovery_refresh_failures"][("files",)] == 1
    f.write_text(json.dumps([{"targets": ["h:2"], "labels": {"worker": "b"}}]))
    assert d.refresh_once() is True
    assert [w.name for w in seen[-1]] == ["b"]
    f.unlink()
    assert d.refresh_once() is True and seen[-1] == ()  # a file that is gone has no targets


# ---- a Prometheus server's targets ----------------------------------------------------------
@pytest.fixture
def prometheus_with_targets(tmp_path: Path) -> Iterator[str]:
    binary = require_tool("/usr/bin/prometheus")
    (tmp_path / "vllm.json").write_text(json.dumps([
        {"targets": ["127.0.0.1:18001", "127.0.0.1:18002"],
         "labels": {"__meta_pod": "vllm-0", "__kv_port": "5557", "node": "n1"}}]))
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1h"},
        "scrape_configs": [
            {"job_name": "vllm", "file_sd_configs": [{"files": [str(tmp_path / "vllm.json")]}],
             "relabel_configs": [{"source_labels": ["__address__"], "target_label": "__meta_pod_address"}]},
            {"job_name": "other", "static_configs": [{"targets": ["127.0.0.1:18009"]}]}]}))
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: len(requests.get(url + "/api/v1/targets", timeout=2).json()["data"]["activeTargets"]) == 3,
                 "Prometheus to discover its targets", timeout=60, ignore=(requests.RequestException, KeyError))
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def test_prometheus_targets_of_one_job_with_their_meta_labels(prometheus_with_targets: str) -> None:
    d, seen, _ = follow(SdProvider("prometheus", "prom", 30.0, url=prometheus_with_targets, job="vllm", relabel=rules(
        {"source_labels": ["__meta_prometheus_label_instance"], "target_label": "worker"},
        {"source_labels": ["__address__", "__kv_port"], "regex": "([^:]+):\\d+;(\\d+)", "target_label": "kv_events",
         "replacement": "tcp://$1:$2"})))
    d.refresh_once(force=True)
    got = {w.name: w for w in seen[-1]}
    assert sorted(got) == ["127.0.0.1:18001", "127.0.0.1:18002"]  # the job "other" is not workers
    w = got["127.0.0.1:18001"]
    assert (w.metrics_url, w.kv_events) == ("http://127.0.0.1:18001/metrics", "tcp://127.0.0.1:5557")


# ---- the routers' worker lists --------------------------------------------------------------
@pytest.mark.parametrize("kind", ["sglang-router", "vllm-router"])
def test_a_router_lists_its_workers(kind: str, tmp_path: Path) -> None:
    bin_dir = require_routers_bin()
    fleet = WorkerFleet([WorkerSpec(f"w{i}") for i in range(2)], options=FleetOptions(delay_scale=0.0)).start()
    router = None
    try:
        router = start_router(kind, bin_dir, fleet.urls, tmp_path, health_interval_s=1)
        names = {urlsplit(w.url).netloc: w.name for w in fleet}
        d, seen, health = follow(SdProvider("router", "router", 15.0, url=router.url))
        d.refresh_once(force=True)
        assert health.counters["prefixscope_discovery_refresh_failures"][("router",)] == 0
        assert {w.name for w in seen[-1]} == set(names)
        assert {w.metrics_url for w in seen[-1]} == {u + "/metrics" for u in fleet.urls}
    finally:
        if router is not None:
            router.stop()
        fleet.stop()


# ---- Dynamo's registry in etcd --------------------------------------------------------------
@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[str]:
    binary = require_tool("/usr/bin/etcd")
    client, peer = free_port(), free_port()
    url = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen([binary, "--name", "test", "--data-dir", str(tmp_path / "etcd"),
                             "--listen-client-urls", url, "--advertise-client-urls", url,
                             "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"test=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: requests.get(url + "/health", timeout=2).json()["health"] == "true", "etcd healthy",
                 timeout=60, ignore=(requests.RequestException, KeyError, ValueError))
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def _register(etcd_url: str, endpoint: str, instance_id: int) -> str:
    """What Dynamo's runtime writes for one served endpoint (lib/runtime/src/component.rs's Instance)."""
    key = f"instances/dynamo/backend/{endpoint}:{instance_id:x}"
    value = {"component": "backend", "endpoint": endpoint, "namespace": "dynamo", "instance_id": instance_id,
             "transport": {"nats_tcp": f"dynamo_backend.{endpoint}-{instance_id:x}"}}
    r = requests.post(etcd_url + "/v3/kv/put", json={"key": _b64(key), "value": _b64(json.dumps(value))}, timeout=5)
    r.raise_for_status()
    return key


def test_dynamo_workers_come_and_go_in_etcd(etcd: str) -> None:
    first = _register(etcd, "generate", 7587888160958628000)
    _register(etcd, "load_metrics", 7587888160958628000)
    _register(etcd, "generate", 7587888160958628001)
    requests.post(etcd + "/v3/kv/put", json={"key": _b64("models/x"), "value": _b64("{}")}, timeout=5)
    d, seen, health = follow(SdProvider("etcd", "dynamo", 15.0, endpoints=("http://127.0.0.1:1", etcd)))
    d.refresh_once(force=True)
    assert sorted(w.name for w in seen[-1]) == ["7587888160958628000", "7587888160958628001"]
    requests.post(etcd + "/v3/kv/deleterange", json={"key": _b64(first)}, timeout=5).raise_for_status()
    requests.post(etcd + "/v3/kv/deleterange", json={"key": _b64(first.replace("generate", "load_metrics"))},
                  timeout=5).raise_for_status()
    assert d.refresh_once(force=True) is True
    assert [w.name for w in seen[-1]] == ["7587888160958628001"]
    assert health.counters["prefixscope_discovery_refresh_failures"][("dynamo",)] == 0


# ---- Kubernetes pods -----------------------------------------------------------------------
# There is no kube-apiserver on this machine. The official `kubernetes` client is run against a
# real HTTP server on 127.0.0.1 that serves *recorded* responses: the pod list and the watch
# events of tests/fixtures/kubernetes/pods.json (shaped after the API reference, validated
# against the API's schema in tests/exporter/codecs/test_discovery_pods.py), a watch streamed as
# the API server streams it (chunked, one JSON event a line), an expired resourceVersion as its
# ERROR event (410), a refusal as a v1.Status of 403. It checks the client's requests and what the
# provider makes of the answers, not an API server's behaviour.
K8S = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "kubernetes" / "pods.json").read_text())


class _ApiServer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    pod_list: ClassVar[dict] = {}
    status = 200
    events: ClassVar[list] = []  # queue.Queue of watch events (None ends the stream)
    requests_seen: ClassVar[list] = []

    def do_GET(self) -> None:
        type(self).requests_seen.append(self.path)
        query = dict(p.split("=", 1) for p in urlsplit(self.path).query.split("&") if "=" in p)
        if query.get("watch", "").lower() == "true" and self.status == 200:
            self._watch()
            return
        body = json.dumps(self.pod_list if self.status == 200 else {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "reason": "Forbidden",
            "message": 'pods is forbidden: User "system:serviceaccount:monitoring:prefixscope" cannot list '
                       'resource "pods" in API group "" in the namespace "llm"', "code": 403}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _watch(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = type(self).events[0]
        while True:
            event = events.get()
            if event is None:
                break
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
            self.wfile.flush()
            if event["type"] == "ERROR":
                break  # the API server ends a watch after its error event
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def log_message(self, *_args: object) -> None:
        pass


@pytest.fixture
def api_server() -> Iterator[tuple[str, type[_ApiServer]]]:
    import queue

    handler = type("Handler", (_ApiServer,), {"pod_list": copy.deepcopy(K8S["list"]), "events": [queue.Queue()],
                                              "requests_seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        for _ in range(4):
            handler.events[0].put(None)  # end the watches still open
        server.shutdown()
        server.server_close()


def test_kubernetes_pods_listed_then_watched_through_the_official_client(
        api_server: tuple[str, type[_ApiServer]]) -> None:
    pytest.importorskip("kubernetes")
    url, server = api_server
    cfg = parse_config({"discovery": {"kubernetes": [{"name": "pods", "api_server": url, "namespaces": ["llm"],
                                                      "label_selector": "app.kubernetes.io/name=vllm"}]}})
    d, seen, health = follow(*cfg.discovery)
    provider = d.providers[0]
    try:
        assert d.refresh_once(force=True)
        names = [w.name for w in seen[-1]]
        assert names == ["vllm-7d9f8c6b5-2xkqp", "vllm-7d9f8c6b5-9mz4w", "sidecar-less-0"]  # the ready ones
        first = seen[-1][0]
        assert (first.metrics_url, first.kv_events, first.replay) == (
            "http://10.244.3.17:8000/metrics", "tcp://10.244.3.17:5557", "tcp://10.244.3.17:5558")
        # The pod's node (spec.nodeName) and its topology annotations place it; the pod without
        # annotations is placed on its node alone (its domain: the node).
        topo, problems = with_discovered(None, {w.name: dict(w.topology) for w in seen[-1]})
        assert problems == {} and topo is not None
        placed = topo.worker("vllm-7d9f8c6b5-2xkqp")
        assert (placed.node, placed.nvlink_domain, placed.gpu_class, placed.warm_pool) == (
            "gpu-node-07", "gpu-node-07/nvl0", "H100", True)
        assert (topo.node_of("sidecar-less-0"), topo.domain_of("sidecar-less-0")) == ("cpu-node-01", "cpu-node-01")
        listed = urlsplit(server.requests_seen[0])
        assert listed.path == "/api/v1/namespaces/llm/pods"
        assert parse_qs(listed.query)["labelSelector"] == ["app.kubernetes.io/name=vllm"]
        wait_for(lambda: any("watch=true" in r.lower() for r in server.requests_seen), what="the watch")
        watched = parse_qs(urlsplit(next(r for r in server.requests_seen if "watch=true" in r.lower())).query)
        assert watched["resourceVersion"] == ["48301"] and watched["allowWatchBookmarks"][0].lower() == "true"

        # The watch: the pod that was not ready becomes ready, one pod terminates and goes.
        events = server.events[0]
        events.put(K8S["watch"][0])
        wait_for(provider.changed, what="the pod turning ready reported")
        d.refresh_once()
        assert "vllm-7d9f8c6b5-tq8rd" in [w.name for w in seen[-1]]
        for e in K8S["watch"][1:]:  # terminating (out at once), deleted, a bookmark
            events.put(e)
        wait_for(lambda: (provider.changed() and d.refresh_once()) or
                 "vllm-7d9f8c6b5-2xkqp" not in [w.name for w in seen[-1]], what="the terminating pod out")
        assert [w.name for w in seen[-1]] == ["vllm-7d9f8c6b5-9mz4w", "vllm-7d9f8c6b5-tq8rd", "sidecar-less-0"]
        assert health.counters["prefixscope_discovery_refresh_failures"][("pods",)] == 0

        # The resourceVersion expires (410): listed again, from the list's new state; no failure.
        lists = sum(1 for r in server.requests_seen if "watch" not in r.lower())
        server.pod_list = {**K8S["list"], "metadata": {"resourceVersion": "48400"},
                           "items": [p for p in K8S["list"]["items"] if p["metadata"]["name"] == "sidecar-less-0"]}
        events.put(K8S["expired"])
        wait_for(lambda: (provider.changed() and d.refresh_once()) or [w.name for w in seen[-1]] == ["sidecar-less-0"],
                 what="listed again after the expired watch")
        assert sum(1 for r in server.requests_seen if "watch" not in r.lower()) == lists + 1
        assert health.counters["prefixscope_discovery_refresh_failures"][("pods",)] == 0

        # Refused (the Role lost its verbs): counted, the last good pods stay.
        server.status = 403
        events.put(None)  # the watch ends; watching again is refused too
        wait_for(provider.changed, what="the refused watch reported")
        assert d.refresh_once() is False
        assert health.counters["prefixscope_discovery_refresh_failures"][("pods",)] == 1
        assert health.counters["prefixscope_ingest_errors"][("discovery", "http_status")] == 1
        assert [w.name for w in seen[-1]] == ["sidecar-less-0"]
    finally:
        d.close()


def test_kubernetes_api_unreachable_is_a_connect_failure() -> None:
    pytest.importorskip("kubernetes")
    cfg = parse_config({"discovery": {"kubernetes": [{"name": "pods", "api_server": f"http://127.0.0.1:{free_port()}",
                                                      "namespaces": ["llm"], "timeout": "2s"}]}})
    d, seen, health = follow(*cfg.discovery)
    try:
        d.refresh_once(force=True)
        assert [w.name for w in seen[-1]] == []
        assert health.counters["prefixscope_ingest_errors"][("discovery", "connect")] == 1
    finally:
        d.close()
