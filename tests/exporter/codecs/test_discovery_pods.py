"""Kubernetes pods → targets → workers, pure: the pod role's meta labels, the default reading of the
prefixscope.io/* annotations and what ``ready_only`` leaves out.

The pods are ``tests/fixtures/kubernetes/pods.json``: shaped after the Kubernetes API reference's
v1.Pod / v1.PodList (its ``_source`` says where each field comes from), and checked here against
the API's own schema for Kubernetes 1.34 (the ``kubernetes-validate`` package, strict: no field
the API does not define).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import kubernetes_validate
import pytest

from exporter.codecs.discovery import pods, relabel
from exporter.codecs.discovery.workers import DiscoveredWorker, worker_of

FIXTURE = json.loads((Path(__file__).resolve().parents[2] / "fixtures" / "kubernetes" / "pods.json").read_text())
ITEMS = {p["metadata"]["name"]: p for p in FIXTURE["list"]["items"]}
READY_V4, READY_V6, NOT_READY, PENDING, PLAIN = ITEMS
DEFAULTS = tuple(relabel.rule(r) for r in pods.DEFAULT_RELABEL)


def worker(pod: dict, *extra: dict, ready_only: bool = True) -> DiscoveredWorker | None:
    target = pods.pod_target(pod, ready_only)
    if target is None:
        return None
    kept = relabel.apply(DEFAULTS + tuple(relabel.rule(r) for r in extra), target)
    return None if kept is None else worker_of(kept)


def test_the_fixture_is_what_the_api_serves() -> None:
    objects = [*FIXTURE["list"]["items"], *(e["object"] for e in FIXTURE["watch"] if e["type"] != "BOOKMARK")]
    for obj in objects:
        kubernetes_validate.validate(obj, "1.34.0", strict=True)
    items, rv = pods.pod_list(FIXTURE["list"])
    assert len(items) == 5 and rv == "48301"


def test_a_ready_pod_has_the_pod_roles_meta_labels() -> None:
    t = pods.pod_target(ITEMS[READY_V4])
    assert t is not None
    p = "__meta_kubernetes_pod_"
    assert t["__meta_kubernetes_namespace"] == "llm"
    assert t[p + "name"] == READY_V4 and t[p + "uid"] == "0b4f7c1e-8d2a-4e55-9a61-3c7e2f9d1a01"
    assert (t[p + "ip"], t[p + "host_ip"], t[p + "node_name"]) == ("10.244.3.17", "10.0.3.7", "gpu-node-07")
    assert (t[p + "ready"], t[p + "phase"]) == ("true", "Running")
    assert t[p + "label_app_kubernetes_io_name"] == "vllm" and t[p + "labelpresent_app_kubernetes_io_name"] == "true"
    assert t[p + "annotation_prefixscope_io_kv_events_port"] == "5557"
    assert t[p + "annotationpresent_prefixscope_io_warm_pool"] == "true"
    assert (t[p + "controller_kind"], t[p + "controller_name"]) == ("ReplicaSet", "vllm-7d9f8c6b5")
    assert (t[p + "container_name"], t[p + "container_port_name"], t[p + "container_port_number"]) == \
        ("vllm", "http", "8000")
    assert t["__address__"] == "10.244.3.17:8000"  # the first declared TCP port


def test_the_annotations_name_the_workers_endpoints_and_topology() -> None:
    w = worker(ITEMS[READY_V4])
    assert w == DiscoveredWorker(
        name=READY_V4, metrics_url="http://10.244.3.17:8000/metrics", kv_events="tcp://10.244.3.17:5557",
        replay="tcp://10.244.3.17:5558", topology=(("node", "gpu-node-07"), ("nvlink_domain", "gpu-node-07/nvl0"),
                                                   ("gpu_class", "H100"), ("warm_pool", "true")))
    v6 = worker(ITEMS[READY_V6])
    assert v6 is not None
    assert v6.metrics_url == "http://[fd00:10:244:4::1b]:8000/metrics"
    assert (v6.kv_events, v6.replay) == ("tcp://[fd00:10:244:4::1b]:5557", "tcp://[fd00:10:244:4::1b]:5558")


def test_a_pod_without_annotations_is_named_and_scraped_by_its_first_port_or_not_at_all() -> None:
    plain = worker(ITEMS[PLAIN])
    assert plain == DiscoveredWorker(name=PLAIN, topology=(("node", "cpu-node-01"),))  # no port, no stream
    ports_no_annotations = copy.deepcopy(ITEMS[READY_V4])
    ports_no_annotations["metadata"]["annotations"] = {}
    w = worker(ports_no_annotations)
    assert w is not None and w.metrics_url == "http://10.244.3.17:8000/metrics" and w.kv_events is None


def test_only_pods_that_can_serve_unless_asked() -> None:
    assert [n for n, p in ITEMS.items() if pods.pod_target(p) is not None] == [READY_V4, READY_V6, PLAIN]
    terminating = next(e["object"] for e in FIXTURE["watch"] if e["object"]["metadata"].get("deletionTimestamp"))
    assert pods.pod_target(terminating) is None  # Ready still true, but being deleted
    everything = {n: pods.pod_target(p, ready_only=False) for n, p in ITEMS.items()}
    assert everything[NOT_READY]["__meta_kubernetes_pod_ready"] == "false"  # type: ignore[index]
    assert "__address__" not in everything[PENDING]  # type: ignore[operator]  # no IP yet
    assert worker(ITEMS[PENDING], ready_only=False) == DiscoveredWorker(name=PENDING, topology=(("gpu_class", "H100"),))


def test_the_configs_own_rules_run_after_the_defaults() -> None:
    w = worker(ITEMS[READY_V4],
               {"source_labels": ["__meta_kubernetes_pod_label_app_kubernetes_io_name"], "regex": "vllm",
                "action": "keep"},
               {"target_label": "__metrics_path__", "replacement": "/engine/metrics"},
               {"source_labels": ["__meta_kubernetes_pod_uid"], "target_label": "worker"})
    assert w is not None
    assert (w.name, w.metrics_url) == ("0b4f7c1e-8d2a-4e55-9a61-3c7e2f9d1a01", "http://10.244.3.17:8000/engine/metrics")
    assert worker(ITEMS[READY_V4], {"source_labels": ["__meta_kubernetes_namespace"], "regex": "llm",
                                    "action": "drop"}) is None


@pytest.mark.parametrize("doc", [None, [], {"metadata": "x"}, {"metadata": {}}, {"metadata": {"name": "a"}, "spec": "x"}])
def test_what_is_not_a_pod_is_refused(doc: object) -> None:
    with pytest.raises(pods.PodFormatError):
        pods.pod_target(doc)


def test_a_list_needs_its_items_and_resource_version() -> None:
    with pytest.raises(pods.PodFormatError):
        pods.pod_list({"items": []})
    with pytest.raises(pods.PodFormatError):
        pods.pod_list({"kind": "Status", "code": 403})
