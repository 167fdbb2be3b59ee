"""Kubernetes pods → target label sets, as Prometheus's ``kubernetes_sd_configs`` (role ``pod``) names them.

A pod is read from the API's own JSON (``v1.Pod``: ``metadata``, ``spec``, ``status``), as a list
or a watch event carries it. Each pod that can serve is one target (one worker: a pod is one
engine, so unlike Prometheus's pod role there is no target per container port) with the pod
role's meta labels:

==================================================== ========================================
``__meta_kubernetes_namespace``                      ``metadata.namespace``
``__meta_kubernetes_pod_name`` / ``_uid``            ``metadata.name`` / ``metadata.uid``
``__meta_kubernetes_pod_label_<name>``               each label (``labelpresent_<name>``: ``true``)
``__meta_kubernetes_pod_annotation_<name>``          each annotation (``annotationpresent_<name>``)
``__meta_kubernetes_pod_ip`` / ``_host_ip``          ``status.podIP`` / ``status.hostIP``
``__meta_kubernetes_pod_node_name``                  ``spec.nodeName``
``__meta_kubernetes_pod_ready`` / ``_phase``         the Ready condition (``true``/``false``/``unknown``) / ``status.phase``
``__meta_kubernetes_pod_controller_kind`` / ``_name`` the controlling owner reference
``__meta_kubernetes_pod_container_name``             the container of the port below (else the first)
``__meta_kubernetes_pod_container_port_name`` / ``_number`` / ``_protocol``
                                                     the pod's first declared TCP container port
``__address__``                                      ``podIP:that port`` (IPv6 in brackets), or none
==================================================== ========================================

Names are sanitised as Prometheus does (every character outside ``[a-zA-Z0-9_]`` becomes ``_``),
so the annotation ``prefixscope.io/kv-events-port`` is ``__meta_kubernetes_pod_annotation_prefixscope_io_kv_events_port``.

:data:`DEFAULT_RELABEL` are the rules that run before a provider's own ``relabel_configs``: they
read the annotations of :data:`ANNOTATIONS` (the pod names its metrics port and path, its
KV-event and replay ports, its topology) into the labels :mod:`.workers` reads, and name the
worker after its pod. Later rules of the config can override any of it.

With ``ready_only`` (the default) a pod is a target only while it can serve: phase ``Running``,
a pod IP, its Ready condition true and no deletion under way (what an EndpointSlice calls ready
and not terminating) — a pod that is starting, failing its readiness probe or terminating is not
in the fleet, so it is never a blind target. Pure: no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

Labels = dict[str, str]
META = "__meta_kubernetes_"
POD = META + "pod_"
_NAME = re.compile(r"[^a-zA-Z0-9_]")

# What a pod's annotations tell the exporter (docs/operating.md, "Recipe: Kubernetes pods").
ANNOTATIONS = {
    "prefixscope.io/metrics-port": "the port of its /metrics (default: its first declared TCP container port)",
    "prefixscope.io/metrics-path": "the path of its metrics (default /metrics)",
    "prefixscope.io/kv-events-port": "its ZMQ KV-event PUB port (vLLM's --kv-events-config endpoint)",
    "prefixscope.io/replay-port": "its ZMQ replay port",
    "prefixscope.io/kv-events-topic": "its KV-event topic (default empty)",
    "prefixscope.io/nvlink-domain": "its NVLink domain",
    "prefixscope.io/gpu-class": "its GPU class (a gpu_classes key of the topology file)",
    "prefixscope.io/warm-pool": "true for a warm-pool worker",
}


class PodFormatError(ValueError):
    """The document is not a pod (or a pod list) as the API serves it."""


def meta_name(name: str) -> str:
    return _NAME.sub("_", name)


def _annotation(name: str) -> str:
    return f"{POD}annotation_{meta_name(name)}"


def _ip_port(ip_label: str, port_label: str, target: str, template: str) -> list[dict[str, Any]]:
    """Two rules: ``template`` filled with the pod IP and a port annotation (IPv6 in brackets)."""
    return [
        {"source_labels": [ip_label, port_label], "regex": r"([^:]+);(\d+)", "target_label": target,
         "replacement": template.format(host="$1", port="$2")},
        {"source_labels": [ip_label, port_label], "regex": r"(.*:.*);(\d+)", "target_label": target,
         "replacement": template.format(host="[$1]", port="$2")},
    ]


def _copy(annotation: str, target: str) -> dict[str, Any]:
    return {"source_labels": [_annotation(annotation)], "regex": "(.+)", "target_label": target}


DEFAULT_RELABEL: tuple[dict[str, Any], ...] = (
    {"source_labels": [POD + "name"], "target_label": "worker"},
    *_ip_port(POD + "ip", _annotation("prefixscope.io/metrics-port"), "__address__", "{host}:{port}"),
    _copy("prefixscope.io/metrics-path", "__metrics_path__"),
    *_ip_port(POD + "ip", _annotation("prefixscope.io/kv-events-port"), "kv_events", "tcp://{host}:{port}"),
    *_ip_port(POD + "ip", _annotation("prefixscope.io/replay-port"), "replay", "tcp://{host}:{port}"),
    _copy("prefixscope.io/kv-events-topic", "topic"),
    {"source_labels": [POD + "node_name"], "regex": "(.+)", "target_label": "node"},
    _copy("prefixscope.io/nvlink-domain", "nvlink_domain"),
    _copy("prefixscope.io/gpu-class", "gpu_class"),
    _copy("prefixscope.io/warm-pool", "warm_pool"),
)


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


def _ready(status: Mapping[str, Any]) -> str:
    for c in status.get("conditions") or ():
        if isinstance(c, Mapping) and c.get("type") == "Ready":
            return {"True": "true", "False": "false"}.get(str(c.get("status")), "unknown")
    return "unknown"


def _first_port(spec: Mapping[str, Any]) -> tuple[Mapping[str, Any], Mapping[str, Any]] | None:
    """(container, port) of the pod's first declared TCP container port."""
    for container in spec.get("containers") or ():
        for port in (container.get("ports") or ()) if isinstance(container, Mapping) else ():
            if isinstance(port, Mapping) and isinstance(port.get("containerPort"), int) \
                    and port.get("protocol", "TCP") == "TCP":
                return container, port
    return None


def serving(pod: Mapping[str, Any]) -> bool:
    """Running, with an IP, Ready, not being deleted."""
    status = pod.get("status") or {}
    return (status.get("phase") == "Running" and bool(status.get("podIP")) and _ready(status) == "true"
            and not (pod.get("metadata") or {}).get("deletionTimestamp"))


def pod_target(pod: Any, ready_only: bool = True) -> Labels | None:
    """The pod's target labels (before relabelling), or None when ``ready_only`` leaves it out."""
    if not isinstance(pod, Mapping) or not isinstance(pod.get("metadata"), Mapping):
        raise PodFormatError(f"expected a v1.Pod with metadata, got {type(pod).__name__}")
    md, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
    if not isinstance(md.get("name"), str) or not isinstance(spec, Mapping) or not isinstance(status, Mapping):
        raise PodFormatError("a pod without metadata.name, or whose spec or status is not an object")
    if ready_only and not serving(pod):
        return None
    out: Labels = {META + "namespace": str(md.get("namespace", "")), POD + "name": md["name"],
                   POD + "uid": str(md.get("uid", "")), POD + "ready": _ready(status),
                   POD + "phase": str(status.get("phase", ""))}
    for key, field in (("ip", "podIP"), ("host_ip", "hostIP")):
        if status.get(field):
            out[POD + key] = str(status[field])
    if spec.get("nodeName"):
        out[POD + "node_name"] = str(spec["nodeName"])
    for kind, values in (("label", md.get("labels")), ("annotation", md.get("annotations"))):
        for k, v in (values or {}).items() if isinstance(values, Mapping) else ():
            out[f"{POD}{kind}_{meta_name(str(k))}"] = str(v)
            out[f"{POD}{kind}present_{meta_name(str(k))}"] = "true"
    for owner in md.get("ownerReferences") or ():
        if isinstance(owner, Mapping) and owner.get("controller"):
            out[POD + "controller_kind"], out[POD + "controller_name"] = str(owner.get("kind")), str(owner.get("name"))
    first = _first_port(spec)
    containers = [c for c in spec.get("containers") or () if isinstance(c, Mapping)]
    if first is not None:
        container, port = first
        out[POD + "container_name"] = str(container.get("name", ""))
        out[POD + "container_port_number"] = str(port["containerPort"])
        out[POD + "container_port_protocol"] = "TCP"
        if port.get("name"):
            out[POD + "container_port_name"] = str(port["name"])
        if out.get(POD + "ip"):
            out["__address__"] = _host_port(out[POD + "ip"], port["containerPort"])
    elif containers:
        out[POD + "container_name"] = str(containers[0].get("name", ""))
    return out


def pod_list(doc: Any) -> tuple[list[Mapping[str, Any]], str]:
    """The pods of a ``v1.PodList`` and its ``metadata.resourceVersion`` (where a watch starts)."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("items"), list):
        raise PodFormatError("expected a v1.PodList (an object with items)")
    rv = (doc.get("metadata") or {}).get("resourceVersion")
    if not isinstance(rv, str):
        raise PodFormatError("a pod list without metadata.resourceVersion")
    return doc["items"], rv


def pod_key(pod: Mapping[str, Any]) -> str:
    """Namespace/name: what a watch event updates."""
    md = pod.get("metadata") or {}
    return f"{md.get('namespace', '')}/{md.get('name', '')}"
