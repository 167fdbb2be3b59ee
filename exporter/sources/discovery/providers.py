"""The I/O of each discovery mechanism: read a file, poll a URL, ask etcd, list and watch pods → target label sets.

Each provider's :meth:`~Provider.refresh` returns the targets it finds now (labels before
relabelling, ``exporter.codecs.discovery.groups``) or raises :class:`DiscoveryFailed` with the
kind it is counted under (``connect``, ``timeout``, ``http_status``, ``format``); the manager
then keeps its last good targets. Every request is bounded by the provider's ``timeout``.
"""

from __future__ import annotations

import base64
import glob
import json
import os
import threading
from typing import Any

import requests
import yaml

from exporter.codecs.discovery import groups, pods
from exporter.config import SdProvider

Labels = dict[str, str]
_GLOB_CHARS = frozenset("*?[")


class DiscoveryFailed(Exception):
    """One refresh failed; ``kind`` is how it is counted."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Provider:
    """A discovery mechanism over one ``SdProvider`` config entry."""

    def __init__(self, cfg: SdProvider) -> None:
        self.cfg = cfg

    def refresh(self) -> list[Labels]:
        raise NotImplementedError

    def changed(self) -> bool:
        """Whether a refresh is due before the interval (a watched file changed)."""
        return False

    def close(self) -> None:
        """Stop what the provider runs on its own (a watch)."""

    # ---- HTTP, shared by the polled mechanisms ---------------------------------------------
    def _get_json(self, url: str, method: str = "GET", body: Any = None) -> Any:
        headers = {"Accept": "application/json",
                   "X-Prometheus-Refresh-Interval-Seconds": str(max(1, int(self.cfg.refresh_interval)))}
        if self.cfg.bearer_token:
            headers["Authorization"] = f"Bearer {self.cfg.bearer_token}"
        try:
            r = requests.request(method, url, json=body, headers=headers, timeout=self.cfg.timeout,
                                 allow_redirects=False)
        except requests.Timeout:
            raise DiscoveryFailed("timeout", f"{url}: no answer within {self.cfg.timeout:g}s") from None
        except requests.RequestException as exc:
            raise DiscoveryFailed("connect", f"{url}: {exc}") from None
        if r.status_code != 200:
            raise DiscoveryFailed("http_status", f"{url}: HTTP {r.status_code} {r.text[:200]!r}")
        try:
            return r.json()
        except ValueError:
            raise DiscoveryFailed("format", f"{url}: not JSON: {r.text[:200]!r}") from None


class FileSd(Provider):
    """Prometheus ``file_sd``: every file matching the patterns, JSON or YAML; a file that cannot
    be read or parsed keeps the targets it had (Prometheus does the same), a file that is gone
    has none. :meth:`changed` compares each file's modification time and size (cheap: a stat)."""

    def __init__(self, cfg: SdProvider) -> None:
        super().__init__(cfg)
        self._signature: tuple[tuple[str, int, int], ...] | None = None
        self._last: dict[str, list[Labels]] = {}  # file -> its last good targets

    def _paths(self) -> list[str]:
        out: list[str] = []
        for pattern in self.cfg.files:
            if _GLOB_CHARS & set(os.path.basename(pattern)):
                out += sorted(glob.glob(pattern))
            elif os.path.exists(pattern):
                out.append(pattern)
        return out

    def _current(self) -> tuple[tuple[str, int, int], ...]:
        sig = []
        for p in self._paths():
            try:
                st = os.stat(p)
            except OSError:
                continue
            sig.append((p, st.st_mtime_ns, st.st_size))
        return tuple(sig)

    def changed(self) -> bool:
        return self._current() != self._signature

    def refresh(self) -> list[Labels]:
        self._signature = self._current()
        out: list[Labels] = []
        failed: list[str] = []
        present = {p for p, _, _ in self._signature}
        self._last = {p: t for p, t in self._last.items() if p in present}
        for path in sorted(present):
            try:
                with open(path, encoding="utf-8") as f:
                    doc = yaml.safe_load(f)  # YAML is a superset of JSON: one parser for both
                self._last[path] = groups.target_groups(doc, {"__meta_filepath": path})
            except (OSError, UnicodeDecodeError, yaml.YAMLError, groups.DiscoveryFormatError) as exc:
                failed.append(f"{path}: {exc}")
            out += self._last.get(path, [])
        if failed:
            raise PartialRefresh(out, DiscoveryFailed("format", "; ".join(failed)))
        return out


class PartialRefresh(Exception):
    """Some files failed: ``targets`` holds the good ones plus the failed ones' last good targets."""

    def __init__(self, targets: list[Labels], failure: DiscoveryFailed) -> None:
        super().__init__(str(failure))
        self.targets = targets
        self.failure = failure


class HttpSd(Provider):
    """Prometheus ``http_sd``: the URL answers a JSON list of target groups."""

    def refresh(self) -> list[Labels]:
        assert self.cfg.url is not None
        try:
            return groups.target_groups(self._get_json(self.cfg.url), {"__meta_url": self.cfg.url})
        except groups.DiscoveryFormatError as exc:
            raise DiscoveryFailed("format", f"{self.cfg.url}: {exc}") from None


class PrometheusSd(Provider):
    """The active targets of one scrape pool of a Prometheus server (``/api/v1/targets``)."""

    def refresh(self) -> list[Labels]:
        assert self.cfg.url is not None and self.cfg.job is not None
        url = self.cfg.url.rstrip("/") + "/api/v1/targets?state=active"
        try:
            return groups.prometheus_targets(self._get_json(url), self.cfg.job)
        except groups.DiscoveryFormatError as exc:
            raise DiscoveryFailed("format", f"{url}: {exc}") from None


class RouterSd(Provider):
    """The workers a router lists: ``GET /workers`` (sglang-router, the SGLang gateway,
    vllm-router), or ``GET /list_workers`` where ``/workers`` is not served."""

    def refresh(self) -> list[Labels]:
        assert self.cfg.url is not None
        base = self.cfg.url.rstrip("/")
        try:
            doc = self._get_json(base + "/workers")
        except DiscoveryFailed as exc:
            if exc.kind != "http_status":
                raise
            doc = self._get_json(base + "/list_workers")
        try:
            return groups.router_workers(doc)
        except groups.DiscoveryFormatError as exc:
            raise DiscoveryFailed("format", f"{base}: {exc}") from None


def _prefix_end(prefix: bytes) -> bytes:
    """etcd's range end for "every key with this prefix": the prefix with its last byte + 1."""
    b = bytearray(prefix)
    for i in range(len(b) - 1, -1, -1):
        if b[i] < 0xFF:
            b[i] += 1
            return bytes(b[: i + 1])
    return b"\x00"  # every key


class EtcdSd(Provider):
    """Dynamo's instance registry: every key under ``prefix`` through etcd's v3 JSON gateway
    (``POST /v3/kv/range``); the endpoints are tried in turn."""

    def refresh(self) -> list[Labels]:
        prefix = self.cfg.prefix.encode()
        body = {"key": base64.b64encode(prefix).decode(), "range_end": base64.b64encode(_prefix_end(prefix)).decode()}
        failures: list[DiscoveryFailed] = []
        for endpoint in self.cfg.endpoints:
            url = endpoint.rstrip("/") + "/v3/kv/range"
            try:
                doc = self._get_json(url, "POST", body)
                pairs = groups.etcd_range(doc)
            except DiscoveryFailed as exc:
                failures.append(exc)
                continue
            except groups.DiscoveryFormatError as exc:
                failures.append(DiscoveryFailed("format", f"{url}: {exc}"))
                continue
            targets, problems = groups.dynamo_instances(pairs)
            if problems:
                raise PartialRefresh(targets, DiscoveryFailed("format", f"{url}: {'; '.join(problems[:3])}"))
            return targets
        raise failures[-1] if failures else DiscoveryFailed("connect", "no etcd endpoint configured")


IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCH_S = 60  # a watch request ends after this long (and is made again): a closed provider stops within it


class KubernetesSd(Provider):
    """Pods of the Kubernetes API through the official client (the ``kubernetes`` extra): each
    namespace is listed, then watched from the list's resourceVersion on a thread of its own, so
    a pod that becomes ready, stops being ready or goes is reported within a second
    (:meth:`changed`). A watch that fails or expires (410 Gone) is followed by a new list at the
    next refresh (at once: the manager checks :meth:`changed` every second); a watch that ends
    normally is made again from the last resourceVersion. The pods' JSON goes through
    :mod:`exporter.codecs.discovery.pods` unmodelled (``_preload_content=False``)."""

    def __init__(self, cfg: SdProvider) -> None:
        super().__init__(cfg)
        from kubernetes import client  # the optional extra: config parsing checked it is there

        self._client = client
        self._api = client.CoreV1Api(client.ApiClient(self._configuration()))
        self._namespaces = cfg.namespaces or (self._own_namespace(),)
        self._lock = threading.Lock()
        self._pods: dict[str, dict[str, dict[str, Any]]] = {ns: {} for ns in self._namespaces}  # ns -> key -> pod
        self._watching: dict[str, threading.Thread] = {}
        # ns -> why its watch ended, a new list being due (None: its resourceVersion expired, no failure)
        self._broken: dict[str, DiscoveryFailed | None] = {}
        self._dirty = threading.Event()
        self._stop = threading.Event()

    def _configuration(self) -> Any:
        from kubernetes import config as kube_config

        c = self._client.Configuration()
        if self.cfg.url:
            c.host = self.cfg.url.rstrip("/")
        elif self.cfg.kubeconfig:
            kube_config.load_kube_config(config_file=self.cfg.kubeconfig, client_configuration=c)
        else:
            kube_config.load_incluster_config(client_configuration=c)
        if self.cfg.bearer_token:
            c.api_key = {"authorization": self.cfg.bearer_token}
            c.api_key_prefix = {"authorization": "Bearer"}
        c.retries = 0  # a failure is counted and retried at the next refresh, not hidden in a loop
        return c

    @staticmethod
    def _own_namespace() -> str:
        try:
            with open(IN_CLUSTER_NAMESPACE, encoding="utf-8") as f:
                return f.read().strip() or "default"
        except OSError:
            return "default"

    def _failure(self, exc: Exception, what: str) -> DiscoveryFailed:
        from urllib3.exceptions import HTTPError, ReadTimeoutError

        if isinstance(exc, DiscoveryFailed):
            return exc
        if isinstance(exc, self._client.ApiException):
            return DiscoveryFailed("http_status", f"{what}: HTTP {exc.status} {exc.reason}")
        if isinstance(exc, ReadTimeoutError | TimeoutError):
            return DiscoveryFailed("timeout", f"{what}: no answer within {self.cfg.timeout:g}s")
        if isinstance(exc, HTTPError | OSError):
            return DiscoveryFailed("connect", f"{what}: {exc}")
        if isinstance(exc, ValueError | pods.PodFormatError):
            return DiscoveryFailed("format", f"{what}: {exc}")
        raise exc

    def _list(self, ns: str) -> str:
        """List the namespace's pods into the cache; returns the list's resourceVersion."""
        try:
            r = self._api.list_namespaced_pod(ns, label_selector=self.cfg.label_selector or "",
                                              _preload_content=False, _request_timeout=self.cfg.timeout)
            items, rv = pods.pod_list(json.loads(r.data))
        except Exception as exc:
            raise self._failure(exc, f"list pods in {ns}") from None
        with self._lock:
            self._pods[ns] = {pods.pod_key(p): p for p in items if isinstance(p, dict)}
        return rv

    def _watch(self, ns: str, rv: str) -> None:
        from kubernetes import watch

        w = watch.Watch()
        while not self._stop.is_set():
            try:
                for event in w.stream(self._api.list_namespaced_pod, ns, label_selector=self.cfg.label_selector or "",
                                      resource_version=rv, timeout_seconds=WATCH_S, allow_watch_bookmarks=True,
                                      _request_timeout=(self.cfg.timeout, WATCH_S + self.cfg.timeout)):
                    if self._stop.is_set():
                        return
                    # raw_object: the pod's JSON as served (the client's ERROR handling needs it there)
                    kind, pod = event.get("type"), event.get("raw_object")
                    if not isinstance(pod, dict):
                        raise pods.PodFormatError(f"a watch event without an object: {str(event)[:200]}")
                    rv = str((pod.get("metadata") or {}).get("resourceVersion") or rv)
                    if kind not in ("ADDED", "MODIFIED", "DELETED"):
                        continue  # BOOKMARK: only its resourceVersion counts
                    with self._lock:
                        if kind == "DELETED":
                            self._pods[ns].pop(pods.pod_key(pod), None)
                        else:
                            self._pods[ns][pods.pod_key(pod)] = pod
                    self._dirty.set()
            except Exception as exc:  # expired (410), refused, cut: a new list at the next refresh
                try:
                    expired = isinstance(exc, self._client.ApiException) and exc.status == 410
                    failure = None if expired else self._failure(exc, f"watch pods in {ns}")
                except Exception:
                    failure = DiscoveryFailed("internal", f"watch pods in {ns}: {type(exc).__name__}: {exc}")
                with self._lock:
                    self._broken[ns] = failure
                self._dirty.set()
                return

    def changed(self) -> bool:
        return self._dirty.is_set()

    def refresh(self) -> list[Labels]:
        self._dirty.clear()
        failures: list[DiscoveryFailed] = []
        for ns in self._namespaces:
            thread = self._watching.get(ns)
            with self._lock:
                ended, broken = ns in self._broken, self._broken.pop(ns, None)
            if thread is not None and thread.is_alive() and not ended:
                continue  # the watch keeps this namespace current
            if broken is not None:
                failures.append(broken)
            try:
                rv = self._list(ns)
            except DiscoveryFailed as exc:
                failures.append(exc)
                continue
            thread = threading.Thread(target=self._watch, args=(ns, rv), name=f"prefixscope-k8s-watch-{ns}",
                                      daemon=True)
            self._watching[ns] = thread
            thread.start()
        targets: list[Labels] = []
        with self._lock:
            current = [p for ns in self._namespaces for p in self._pods[ns].values()]
        bad: list[str] = []
        for pod in current:
            try:
                t = pods.pod_target(pod, self.cfg.ready_only)
            except pods.PodFormatError as exc:
                bad.append(str(exc))
                continue
            if t is not None:
                targets.append(t)
        if bad:
            failures.append(DiscoveryFailed("format", "; ".join(bad[:3])))
        if failures:
            raise PartialRefresh(targets, failures[-1])
        return targets

    def close(self) -> None:
        self._stop.set()


PROVIDERS: dict[str, type[Provider]] = {"file_sd": FileSd, "http_sd": HttpSd, "prometheus": PrometheusSd,
                                        "router": RouterSd, "etcd": EtcdSd, "kubernetes": KubernetesSd}


def provider(cfg: SdProvider) -> Provider:
    return PROVIDERS[cfg.mechanism](cfg)

