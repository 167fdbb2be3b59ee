"""The I/O of each discovery mechanism: read a file, poll a URL, ask etcd → target label sets.

Each provider's :meth:`~Provider.refresh` returns the targets it finds now (labels before
relabelling, ``exporter.codecs.discovery.groups``) or raises :class:`DiscoveryFailed` with the
kind it is counted under (``connect``, ``timeout``, ``http_status``, ``format``); the manager
then keeps its last good targets. Every request is bounded by the provider's ``timeout``.
"""

from __future__ import annotations

import base64
import glob
import os
from typing import Any

import requests
import yaml

from exporter.codecs.discovery import groups
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


PROVIDERS: dict[str, type[Provider]] = {"file_sd": FileSd, "http_sd": HttpSd, "prometheus": PrometheusSd,
                                        "router": RouterSd, "etcd": EtcdSd}


def provider(cfg: SdProvider) -> Provider:
    return PROVIDERS[cfg.mechanism](cfg)

