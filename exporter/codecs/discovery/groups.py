"""Discovered targets from the formats service discovery speaks, as label sets before relabelling.

Each function takes a parsed document (JSON or YAML already decoded) and returns a list of
targets, each a dict of labels with ``__address__`` (``host:port``) where the format has one and
``__meta_*`` labels for what else it says — the shape Prometheus hands its own relabelling, so
``relabel_configs`` written for Prometheus work here. A document that is not the format raises
:class:`DiscoveryFormatError` with what was wrong; the caller keeps its last good targets.

- :func:`target_groups`: Prometheus's ``file_sd`` and ``http_sd`` format, a list of
  ``{"targets": ["host:port", ...], "labels": {...}}``;
- :func:`prometheus_targets`: a Prometheus server's ``GET /api/v1/targets`` answer, the active
  targets of one scrape pool (job) — their discovered labels (``__meta_kubernetes_*``,
  ``__meta_consul_*``, …), the address Prometheus scrapes, and its final labels as
  ``__meta_prometheus_label_<name>``;
- :func:`router_workers`: the worker list of sglang-router / the SGLang gateway and vllm-router
  (``GET /workers``: ``{"workers": [{"url", "model_id", "is_healthy", "worker_type", ...}]}``, or
  ``GET /list_workers``: ``{"urls": [...]}``);
- :func:`dynamo_instances`: Dynamo's instance registry in etcd (keys
  ``instances/<namespace>/<component>/<endpoint>:<lease>``, each value a JSON ``Instance``
  ``{namespace, component, endpoint, instance_id, transport}``), one target per ``instance_id``
  named as Dynamo's KV events name the worker.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

Labels = dict[str, str]
_META_NAME = re.compile(r"[^a-zA-Z0-9_]")


class DiscoveryFormatError(ValueError):
    """The document is not the discovery format it should be; the message says where."""


def _meta(name: str) -> str:
    return _META_NAME.sub("_", name)


def _scalar(value: Any) -> str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str | int | float):
        return str(value)
    return None


def target_groups(doc: Any, meta: Mapping[str, str] | None = None) -> list[Labels]:
    """Targets of a ``file_sd`` / ``http_sd`` document; ``meta`` labels (``__meta_filepath``,
    ``__meta_url``) are added to each. An empty document (``null``) is no targets."""
    if doc is None:
        return []
    if not isinstance(doc, list):
        raise DiscoveryFormatError(f"expected a list of target groups, got {type(doc).__name__}")
    out: list[Labels] = []
    for i, group in enumerate(doc):
        if not isinstance(group, Mapping):
            raise DiscoveryFormatError(f"[{i}]: expected a target group (targets, labels), got {type(group).__name__}")
        targets = group.get("targets") or []
        labels = group.get("labels") or {}
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise DiscoveryFormatError(f"[{i}].targets: expected a list of host:port strings")
        if not isinstance(labels, Mapping) or not all(isinstance(k, str) and _scalar(v) is not None
                                                     for k, v in labels.items()):
            raise DiscoveryFormatError(f"[{i}].labels: expected a mapping of label names to strings")
        for t in targets:
            out.append({**(meta or {}), **{k: str(_scalar(v)) for k, v in labels.items()}, "__address__": t})
    return out


def _address_labels(url: str) -> Labels:
    """``__address__``, ``__scheme__`` and ``__metrics_path__`` of a URL (as Prometheus splits a target)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise DiscoveryFormatError(f"not an http(s) URL: {url!r}")
    out = {"__address__": parts.netloc, "__scheme__": parts.scheme}
    if parts.path not in ("", "/"):
        out["__metrics_path__"] = parts.path
    return out


def prometheus_targets(doc: Any, job: str) -> list[Labels]:
    """The active targets of scrape pool ``job`` from a ``/api/v1/targets`` answer."""
    if not isinstance(doc, Mapping) or doc.get("status") != "success" or not isinstance(doc.get("data"), Mapping):
        raise DiscoveryFormatError("not a Prometheus API answer with status success and data")
    active = doc["data"].get("activeTargets")
    if not isinstance(active, list):
        raise DiscoveryFormatError("data.activeTargets: expected a list")
    out: list[Labels] = []
    for i, t in enumerate(active):
        if not isinstance(t, Mapping):
            raise DiscoveryFormatError(f"data.activeTargets[{i}]: expected an object")
        final = t.get("labels") if isinstance(t.get("labels"), Mapping) else {}
        pool = t.get("scrapePool") or final.get("job")
        if pool != job:
            continue
        discovered = t.get("discoveredLabels") if isinstance(t.get("discoveredLabels"), Mapping) else {}
        labels: Labels = {str(k): str(v) for k, v in discovered.items() if isinstance(v, str)}
        labels.update({f"__meta_prometheus_label_{_meta(str(k))}": str(v) for k, v in final.items()
                       if isinstance(v, str)})
        labels["__meta_prometheus_scrape_pool"] = str(pool)
        labels["__meta_prometheus_health"] = str(t.get("health", "unknown"))
        url = t.get("scrapeUrl")
        if isinstance(url, str) and url:
            labels["__meta_prometheus_scrape_url"] = url
            labels.update(_address_labels(url))  # what Prometheus scrapes, after its own relabelling
        if "instance" in final:
            labels.setdefault("instance", str(final["instance"]))
        if "__address__" in labels:
            out.append(labels)
    return out


def router_workers(doc: Any) -> list[Labels]:
    """The workers a router lists (``/workers`` or ``/list_workers``)."""
    if isinstance(doc, Mapping) and isinstance(doc.get("urls"), list):
        entries: list[Any] = [{"url": u} for u in doc["urls"]]
    elif isinstance(doc, Mapping) and isinstance(doc.get("workers"), list):
        entries = doc["workers"]
    else:
        raise DiscoveryFormatError('expected {"workers": [...]} or {"urls": [...]}')
    out: list[Labels] = []
    for i, w in enumerate(entries):
        url = w.get("url") if isinstance(w, Mapping) else None
        if not isinstance(url, str):
            raise DiscoveryFormatError(f"workers[{i}]: expected an object with a url")
        labels = {**_address_labels(url), "__meta_router_worker_url": url}
        labels.pop("__metrics_path__", None)  # the worker's base URL: its /metrics is below it
        for key in ("model_id", "worker_type", "is_healthy", "id", "connection_mode"):
            value = _scalar(w.get(key))
            if value is not None:
                labels[f"__meta_router_{_meta(key)}"] = value
        out.append(labels)
    return out


def _b64(value: Any, what: str) -> bytes:
    if not isinstance(value, str):
        raise DiscoveryFormatError(f"{what}: expected a base64 string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise DiscoveryFormatError(f"{what}: not base64") from None


def etcd_range(doc: Any) -> list[tuple[str, bytes]]:
    """(key, value) pairs of an etcd v3 ``/v3/kv/range`` answer (JSON gateway: base64 fields)."""
    if not isinstance(doc, Mapping) or "header" not in doc:
        raise DiscoveryFormatError("not an etcd v3 range answer (no header)")
    kvs = doc.get("kvs") or []
    if not isinstance(kvs, list):
        raise DiscoveryFormatError("kvs: expected a list")
    out = []
    for i, kv in enumerate(kvs):
        if not isinstance(kv, Mapping):
            raise DiscoveryFormatError(f"kvs[{i}]: expected an object")
        key = _b64(kv.get("key"), f"kvs[{i}].key").decode("utf-8", "replace")
        out.append((key, _b64(kv.get("value", ""), f"kvs[{i}].value")))
    return out


def dynamo_instances(pairs: list[tuple[str, bytes]]) -> tuple[list[Labels], list[str]]:
    """One target per Dynamo ``instance_id`` from the registry's (key, value) pairs, and the
    problems of entries that are not instances (skipped)."""
    by_id: dict[str, Labels] = {}
    endpoints: dict[str, set[str]] = {}
    problems: list[str] = []
    for key, raw in pairs:
        try:
            value = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            problems.append(f"{key}: not JSON: {exc}")
            continue
        if not isinstance(value, Mapping) or not isinstance(value.get("instance_id"), int) \
                or isinstance(value.get("instance_id"), bool):
            problems.append(f"{key}: not a Dynamo instance (no integer instance_id)")
            continue
        iid = str(value["instance_id"] if value["instance_id"] >= 0 else value["instance_id"] + (1 << 64))
        labels = by_id.setdefault(iid, {"worker": iid, "__meta_dynamo_instance_id": iid, "__meta_etcd_key": key})
        for field, v in value.items():
            s = _scalar(v)
            if s is not None and field not in ("instance_id", "endpoint"):
                labels.setdefault(f"__meta_dynamo_{_meta(field)}", s)
        transport = value.get("transport")
        if isinstance(transport, Mapping) and transport:
            kind, addr = next(iter(transport.items()))
            labels.setdefault("__meta_dynamo_transport", f"{kind}:{addr}")
        if isinstance(value.get("endpoint"), str):
            endpoints.setdefault(iid, set()).add(value["endpoint"])
    for iid, eps in endpoints.items():
        # every endpoint the instance serves, comma-delimited (as Prometheus joins tags): ,generate,load_metrics,
        by_id[iid]["__meta_dynamo_endpoints"] = "," + ",".join(sorted(eps)) + ","
    return list(by_id.values()), problems
