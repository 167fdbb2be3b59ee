"""A relabelled target → the worker it names: its name, metrics URL, KV-event and replay endpoints.

After relabelling, these labels are read (everything else is ignored; ``__meta_*`` labels are
there to be relabelled from):

==================== =====================================================================
``worker``           the worker's name (default: ``instance``, then ``__address__``)
``__address__``      ``host:port`` of its HTTP server; with ``__scheme__`` (``http``) and
                     ``__metrics_path__`` (``/metrics``) the metrics URL
``kv_events``        its ZMQ PUB endpoint (``tcp://host:5557``) — or ``kv_events_port``: the
                     same host as ``__address__`` on that port
``replay``           its ZMQ replay endpoint — or ``replay_port``
``topic``            its KV-event topic (default empty)
``optional``         ``true``: its being down is not a telemetry failure
``node``, ``nvlink_domain``, ``gpu_class``, ``gpus``, ``warm_pool``
                     topology fields, kept with the worker: they place it
                     (``prefixscope.topology.with_discovered``)
==================== =====================================================================

A target with neither an address nor a KV stream still names a worker (Dynamo's registry): it is
in the fleet, its departure is a departure. Pure; a target that cannot be a worker raises
:class:`BadTarget` (the caller counts it and skips it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prefixscope.topology import DISCOVERED_FIELDS

TOPOLOGY_LABELS = DISCOVERED_FIELDS
_KV_SCHEMES = ("tcp://", "ipc://", "inproc://", "nats://", "tls://")


class BadTarget(ValueError):
    """The target's labels do not make a worker."""


@dataclass(frozen=True)
class DiscoveredWorker:
    name: str
    metrics_url: str | None = None
    kv_events: str | None = None
    replay: str | None = None
    topic: str = ""
    optional: bool = False
    topology: tuple[tuple[str, str], ...] = ()  # (field, value) of TOPOLOGY_LABELS present


def _host(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise BadTarget(f'__address__ "{address}" is not host:port')
    return host


def _endpoint(labels: Mapping[str, str], key: str, host: str | None) -> str | None:
    value = labels.get(key)
    if value:
        if not value.startswith(_KV_SCHEMES):
            raise BadTarget(f'{key} "{value}" is not a ZMQ endpoint (tcp://host:port) or nats:// URL')
        return value
    port = labels.get(f"{key}_port")
    if port:
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise BadTarget(f'{key}_port "{port}" is not a port number')
        if host is None:
            raise BadTarget(f"{key}_port needs __address__ (its host)")
        return f"tcp://{host}:{port}"
    return None


def worker_of(labels: Mapping[str, str]) -> DiscoveredWorker:
    address = labels.get("__address__") or None
    host = _host(address) if address else None
    name = labels.get("worker") or labels.get("instance") or address
    if not name:
        raise BadTarget("no worker name: set the worker label (or __address__)")
    metrics_url = None
    if address:
        scheme = labels.get("__scheme__") or "http"
        if scheme not in ("http", "https"):
            raise BadTarget(f'__scheme__ "{scheme}" is not http or https')
        path = labels.get("__metrics_path__") or "/metrics"
        metrics_url = f"{scheme}://{address}{path if path.startswith('/') else '/' + path}"
    kv = _endpoint(labels, "kv_events", host)
    replay = _endpoint(labels, "replay", host)
    if replay is not None and kv is None:
        raise BadTarget("replay needs kv_events")
    if replay is not None and kv is not None and kv.startswith(("nats://", "tls://")):
        raise BadTarget("a worker read from NATS has no replay socket")
    topology = tuple((k, labels[k]) for k in TOPOLOGY_LABELS if labels.get(k))
    return DiscoveredWorker(name=name, metrics_url=metrics_url, kv_events=kv, replay=replay,
                            topic=labels.get("topic", ""), optional=labels.get("optional", "").lower() == "true",
                            topology=topology)
