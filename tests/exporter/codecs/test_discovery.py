"""Discovery, pure: target groups, relabelling with Prometheus's semantics, target → worker.

The relabelling cases are Prometheus's own documented behaviour (``relabel_config`` in the
configuration reference): anchored regexes, ``$1``/``${name}`` replacements, an empty result
deleting the label, keep/drop, labelmap, hashmod. The other formats are exercised against the
real servers in ``tests/exporter/sources/test_discovery_sources.py``.
"""

from __future__ import annotations

import pytest

from exporter.codecs.discovery import groups, relabel
from exporter.codecs.discovery.workers import BadTarget, worker_of


def rules(*raw: dict) -> list[relabel.Rule]:
    return [relabel.rule(r) for r in raw]


def test_replace_is_anchored_and_expands_groups() -> None:
    labels = {"__meta_kubernetes_pod_name": "vllm-7f9c-0", "__address__": "10.0.0.5:8000"}
    out = relabel.apply(rules(
        {"source_labels": ["__meta_kubernetes_pod_name"], "regex": "vllm-(.*)", "target_label": "worker",
         "replacement": "w-$1"},
        {"source_labels": ["__meta_kubernetes_pod_name"], "regex": "7f9c", "target_label": "never"},  # not anchored: no match
        {"source_labels": ["__address__"], "regex": "(?P<host>[^:]+):\\d+", "target_label": "kv_events",
         "replacement": "tcp://${host}:5557"},
    ), labels)
    assert out == {**labels, "worker": "w-7f9c-0", "kv_events": "tcp://10.0.0.5:5557"}


def test_an_empty_replacement_deletes_and_sources_join_with_the_separator() -> None:
    out = relabel.apply(rules(
        {"source_labels": ["a", "b"], "regex": "x;y", "target_label": "joined", "replacement": "ok"},
        {"source_labels": ["a"], "target_label": "c", "replacement": ""},
    ), {"a": "x", "b": "y", "c": "gone"})
    assert out == {"a": "x", "b": "y", "joined": "ok"}


def test_keep_drop_and_label_actions() -> None:
    base = {"__meta_role": "decode", "__meta_kubernetes_pod_label_app": "vllm", "tmp": "1"}
    assert relabel.apply(rules({"source_labels": ["__meta_role"], "regex": "prefill", "action": "keep"}), base) is None
    assert relabel.apply(rules({"source_labels": ["__meta_role"], "regex": "decode", "action": "drop"}), base) is None
    out = relabel.apply(rules({"regex": "__meta_kubernetes_pod_label_(.+)", "action": "labelmap"},
                              {"regex": "tmp", "action": "labeldrop"},
                              {"source_labels": ["app"], "target_label": "APP", "action": "uppercase"}), base)
    assert out == {"__meta_role": "decode", "__meta_kubernetes_pod_label_app": "vllm", "app": "vllm", "APP": "VLLM"}


def test_hashmod_spreads_targets_as_prometheus_does() -> None:
    # Prometheus: the last 8 bytes of the MD5 of the value, big-endian, modulo the modulus.
    import hashlib
    value = "10.0.0.7:8000"
    want = int.from_bytes(hashlib.md5(value.encode()).digest()[8:], "big") % 3
    out = relabel.apply(rules({"source_labels": ["__address__"], "modulus": 3, "target_label": "__shard",
                               "action": "hashmod"}), {"__address__": value})
    assert out is not None and out["__shard"] == str(want)


@pytest.mark.parametrize(("raw", "problem"), [
    ({"action": "explode"}, "unknown action"),
    ({"regex": "(", "target_label": "x"}, "regex"),
    ({"action": "replace"}, "needs target_label"),
    ({"action": "hashmod", "target_label": "x"}, "modulus"),
])
def test_bad_rules_are_refused(raw: dict, problem: str) -> None:
    with pytest.raises(relabel.RelabelError, match=problem):
        relabel.rule(raw)


def test_target_groups_and_their_errors() -> None:
    doc = [{"targets": ["a:1", "b:2"], "labels": {"worker_pool": "gpu", "n": 3}}, {"targets": []}]
    got = groups.target_groups(doc, {"__meta_filepath": "/x.json"})
    assert got == [{"__meta_filepath": "/x.json", "worker_pool": "gpu", "n": "3", "__address__": "a:1"},
                   {"__meta_filepath": "/x.json", "worker_pool": "gpu", "n": "3", "__address__": "b:2"}]
    assert groups.target_groups(None) == []
    for bad in ({"targets": []}, [{"targets": "a:1"}], [{"targets": ["a:1"], "labels": ["x"]}]):
        with pytest.raises(groups.DiscoveryFormatError):
            groups.target_groups(bad)


def test_a_target_names_its_worker_and_endpoints() -> None:
    w = worker_of({"__address__": "10.0.0.5:8000", "instance": "pod-0", "kv_events_port": "5557",
                   "replay_port": "5558", "topic": "kv", "node": "n1", "nvlink_domain": "d1", "optional": "true"})
    assert (w.name, w.metrics_url, w.kv_events, w.replay, w.topic, w.optional) == (
        "pod-0", "http://10.0.0.5:8000/metrics", "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "kv", True)
    assert dict(w.topology) == {"node": "n1", "nvlink_domain": "d1"}
    w = worker_of({"__address__": "h:9", "__scheme__": "https", "__metrics_path__": "/m", "worker": "w"})
    assert (w.name, w.metrics_url, w.kv_events) == ("w", "https://h:9/m", None)
    assert worker_of({"worker": "7587888160958628000"}).metrics_url is None  # Dynamo: a name alone
    for bad in ({}, {"__address__": "nohost"}, {"__address__": "h:1", "kv_events": "http://x"},
                {"__address__": "h:1", "replay_port": "5558"}, {"worker": "w", "kv_events_port": "5557"}):
        with pytest.raises(BadTarget):
            worker_of(bad)


def test_dynamo_instances_are_one_worker_per_instance_id() -> None:
    def entry(endpoint: str, iid: int) -> tuple[str, bytes]:
        # The shape Dynamo's runtime writes (lib/runtime/src/component.rs, Instance with serde's names).
        return (f"instances/dynamo/backend/{endpoint}:{iid:x}",
                (f'{{"component":"backend","endpoint":"{endpoint}","namespace":"dynamo","instance_id":{iid},'
                 f'"transport":{{"nats_tcp":"dynamo_backend.{endpoint}-{iid:x}"}}}}').encode())
    pairs = [entry("generate", 7587888160958628000), entry("load_metrics", 7587888160958628000),
             entry("generate", 42), ("instances/x", b"not json")]
    targets, problems = groups.dynamo_instances(pairs)
    assert [t["worker"] for t in targets] == ["7587888160958628000", "42"]
    assert targets[0]["__meta_dynamo_endpoints"] == ",generate,load_metrics,"
    assert targets[0]["__meta_dynamo_component"] == "backend"
    assert targets[0]["__meta_dynamo_transport"].startswith("nats_tcp:dynamo_backend.generate-")
    assert len(problems) == 1 and "not JSON" in problems[0]
