"""The topology file format: which workers exist, where they sit and what they can do.

A topology file (YAML, ``prefixscope.topology/v1``, documented in docs/topology.md) names
the model and the workers with their node, NVLink domain, GPU class, GPU count and warm-pool
membership — the placement fields, required, and all the exporter reads besides the optional
``kv_blocks`` (capacity when the engine does not say), ``price_per_gpu_hour`` (cold-prefill
cost) and ``max_concurrency`` (warm-pool utilisation). GPU classes may carry a capability
vector (seed §4: prefill_tps, decode_tps, intra-/inter-node bandwidth) that only the simulator
needs; :meth:`Topology.require_simulator_fields` says what a file lacks for it. A worker may
override any class field.

Validation collects every problem and raises :class:`TopologyError` whose message names the
file, the field and the problem, e.g. ``default.yaml: workers[3].prefill_tps: must be a
positive number, got "fast"``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

SCHEMA = "prefixscope.topology/v1"

# Capability fields a GPU class defines and a worker may override: (name, kind).
CAPABILITY_FIELDS: tuple[tuple[str, str], ...] = (
    ("prefill_tps", "positive"),
    ("decode_tps", "positive"),
    ("kv_blocks", "positive_int"),
    ("intra_node_gbps", "positive"),
    ("inter_node_gbps", "positive"),
    ("price_per_gpu_hour", "non_negative"),
    ("max_concurrency", "positive_int"),
)
# What only the simulator needs: a real cluster's topology file may leave these out.
SIMULATOR_FIELDS = ("prefill_tps", "decode_tps", "kv_blocks", "intra_node_gbps", "inter_node_gbps")


class TopologyError(ValueError):
    """An invalid topology file; the message lists ``file: field: problem`` lines."""


@dataclass(frozen=True, slots=True)
class WorkerTopo:
    name: str
    node: str
    nvlink_domain: str
    gpu_class: str
    gpus: int
    warm_pool: bool
    # Optional for the exporter; None when the file does not say.
    prefill_tps: float | None = None  # prompt tokens per second per worker (all its GPUs together)
    decode_tps: float | None = None  # decode tokens per second of each running request
    kv_blocks: int | None = None  # KV-cache capacity in blocks (num_gpu_blocks)
    intra_node_gbps: float | None = None  # NVLink/NVSwitch bandwidth (GB/s) for KV moved within the node
    inter_node_gbps: float | None = None  # network bandwidth (GB/s) for KV moved across nodes
    price_per_gpu_hour: float | None = None  # USD
    max_concurrency: int | None = None  # running requests at most (vLLM's max_num_seqs)


@dataclass(frozen=True)
class Topology:
    model: str
    block_size: int
    workers: tuple[WorkerTopo, ...]
    downgrade_model: str | None = None
    kv_bytes_per_token: int = 131072  # KV size of one token (moves during soft migration)
    source: str = "<topology>"

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {w.name: w for w in self.workers})

    def worker(self, name: str) -> WorkerTopo:
        return self._by_name[name]  # type: ignore[attr-defined]

    def __contains__(self, name: str) -> bool:
        return name in self._by_name  # type: ignore[attr-defined]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workers)

    @property
    def warm_pool(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workers if w.warm_pool)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.node for w in self.workers))

    @property
    def domains(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(w.nvlink_domain for w in self.workers))

    def domain_of(self, name: str) -> str:
        return self.worker(name).nvlink_domain

    def node_of(self, name: str) -> str:
        return self.worker(name).node

    def require_simulator_fields(self) -> Topology:
        """This topology, if every worker has what the simulator needs; else every gap at once."""
        lines = [f"{self.source}: workers[{i}].{f}: missing (the simulator needs it; set it on the "
                 f"worker or on gpu_classes.{w.gpu_class})"
                 for i, w in enumerate(self.workers) for f in SIMULATOR_FIELDS if getattr(w, f) is None]
        if lines:
            raise TopologyError("\n".join(lines))
        return self

    def transfer_seconds(self, tokens: int, src: str, dst: str) -> float:
        """Time to move ``tokens`` of KV from ``src`` to ``dst`` (soft migration, seed §4)."""
        a, b = self.worker(src), self.worker(dst)
        pair = (a.intra_node_gbps, b.intra_node_gbps) if a.node == b.node else (a.inter_node_gbps, b.inter_node_gbps)
        gbps = min(g for g in pair if g is not None)
        return tokens * self.kv_bytes_per_token / (gbps * 1e9)

    def with_workers(self, n: int) -> Topology:
        """The first ``n`` workers, or the fleet grown to ``n`` by repeating its node layout."""
        if n <= 0:
            raise TopologyError(f"{self.source}: workers: --workers must be positive, got {n}")
        if n <= len(self.workers):
            return replace(self, workers=self.workers[:n])
        grown = list(self.workers)
        base = len(self.workers)
        for i in range(base, n):
            src = self.workers[i % base]
            copy_no = i // base
            node = f"{src.node}-r{copy_no}"
            grown.append(replace(src, name=f"{src.name}-r{copy_no}", node=node,
                                 nvlink_domain=f"{src.nvlink_domain}-r{copy_no}"))
        return replace(self, workers=tuple(grown))

    def as_dict(self) -> dict[str, Any]:
        """Plain data in the topology file format (every worker spells out its capabilities)."""
        data: dict[str, Any] = {"schema": SCHEMA, "model": self.model, "block_size": self.block_size,
                                "kv_bytes_per_token": self.kv_bytes_per_token,
                                "gpu_classes": {w.gpu_class: {} for w in self.workers},
                                "workers": [{f: getattr(w, f) for f in w.__slots__} for w in self.workers]}
        if self.downgrade_model:
            data["downgrade_model"] = self.downgrade_model
        return data


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------
def show_value(v: Any) -> str:
    return f'"{v}"' if isinstance(v, str) else repr(v)


class FieldErrors:
    def __init__(self, source: str) -> None:
        self.source = source
        self.lines: list[str] = []

    def add(self, field: str, problem: str) -> None:
        self.lines.append(f"{self.source}: {field}: {problem}")

    def raise_if_any(self, cls: type[ValueError]) -> None:
        if self.lines:
            raise cls("\n".join(self.lines))


def check_value(errors: FieldErrors, field: str, value: Any, kind: str) -> Any:
    """Validate one scalar; returns the value (converted) or None after recording a problem."""
    if kind in ("positive", "non_negative", "positive_int", "non_negative_int", "ratio"):
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if kind.endswith("_int"):
            ok = ok and float(value).is_integer()
        if ok and kind.startswith("positive"):
            ok = value > 0
        if ok and kind.startswith("non_negative"):
            ok = value >= 0
        if ok and kind == "ratio":
            ok = 0 <= value <= 1
        if not ok:
            what = {"positive": "a positive number", "non_negative": "a number ≥ 0",
                    "positive_int": "a positive integer", "non_negative_int": "an integer ≥ 0",
                    "ratio": "a number between 0 and 1"}[kind]
            errors.add(field, f"must be {what}, got {show_value(value)}")
            return None
        return int(value) if kind.endswith("_int") else float(value)
    if kind == "name":
        if not isinstance(value, str) or not value.strip():
            errors.add(field, f"must be a non-empty string, got {show_value(value)}")
            return None
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            errors.add(field, f"must be true or false, got {show_value(value)}")
            return None
        return value
    raise AssertionError(kind)


def check_keys(errors: FieldErrors, where: str, data: Mapping, allowed: Iterable[str]) -> None:
    allowed = set(allowed)
    for k in data:
        if k not in allowed:
            errors.add(f"{where}{k}" if where else str(k), f"unknown field (allowed: {', '.join(sorted(allowed))})")


def load_yaml_mapping(path: Path, error_cls: type[ValueError]) -> dict:
    """Read a YAML file that must hold a mapping; problems name the file."""
    name = path.name
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error_cls(f"{name}: cannot read file: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}" if mark is not None else "document"
        raise error_cls(f"{name}: {where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise error_cls(f"{name}: (top level): must be a mapping, got {type(data).__name__}")
    return data


def parse_topology(data: Mapping[str, Any], source: str = "<topology>") -> Topology:
    """Validate plain data (a parsed topology file) into a :class:`Topology`."""
    e = FieldErrors(source)
    if not isinstance(data, Mapping):
        e.add("(top level)", f"must be a mapping, got {type(data).__name__}")
        e.raise_if_any(TopologyError)
    check_keys(e, "", data, ("schema", "model", "downgrade_model", "block_size", "kv_bytes_per_token",
                             "gpu_classes", "workers"))
    if data.get("schema", SCHEMA) != SCHEMA:
        e.add("schema", f"must be {SCHEMA!r}, got {show_value(data.get('schema'))}")
    model = check_value(e, "model", data.get("model"), "name")
    downgrade = data.get("downgrade_model")
    if downgrade is not None:
        downgrade = check_value(e, "downgrade_model", downgrade, "name")
    block_size = check_value(e, "block_size", data.get("block_size", 16), "positive_int")
    kv_bytes = check_value(e, "kv_bytes_per_token", data.get("kv_bytes_per_token", 131072), "positive_int")

    classes_raw = data.get("gpu_classes", {})
    classes: dict[str, dict[str, Any]] = {}
    if not isinstance(classes_raw, Mapping):
        e.add("gpu_classes", f"must be a mapping of class name to capabilities, got {type(classes_raw).__name__}")
        classes_raw = {}
    for cname, caps in classes_raw.items():
        where = f"gpu_classes.{cname}"
        if not isinstance(caps, Mapping):
            e.add(where, f"must be a mapping, got {type(caps).__name__}")
            continue
        check_keys(e, where + ".", caps, (f for f, _ in CAPABILITY_FIELDS))
        classes[str(cname)] = {f: check_value(e, f"{where}.{f}", caps[f], kind)
                               for f, kind in CAPABILITY_FIELDS if f in caps}

    workers_raw = data.get("workers")
    workers: list[WorkerTopo] = []
    if not isinstance(workers_raw, list) or not workers_raw:
        e.add("workers", f"must be a non-empty list, got {show_value(workers_raw)}")
        workers_raw = []
    seen: set[str] = set()
    domain_node: dict[str, tuple[str, int]] = {}
    for i, w in enumerate(workers_raw):
        where = f"workers[{i}]"
        problems_before = len(e.lines)
        if not isinstance(w, Mapping):
            e.add(where, f"must be a mapping, got {type(w).__name__}")
            continue
        check_keys(e, where + ".", w, ("name", "node", "nvlink_domain", "gpu_class", "gpus", "warm_pool",
                                       *(f for f, _ in CAPABILITY_FIELDS)))
        name = check_value(e, f"{where}.name", w.get("name"), "name")
        if name is not None and name in seen:
            e.add(f"{where}.name", f"duplicate worker name {show_value(name)}")
        seen.add(name)
        node = check_value(e, f"{where}.node", w.get("node"), "name")
        domain = check_value(e, f"{where}.nvlink_domain", w.get("nvlink_domain"), "name")
        if domain is not None and node is not None:
            prev = domain_node.setdefault(domain, (node, i))
            if prev[0] != node:
                e.add(f"{where}.nvlink_domain", f"domain {show_value(domain)} is on node {show_value(prev[0])} "
                      f"(workers[{prev[1]}]); an NVLink domain cannot span nodes")
        gclass = check_value(e, f"{where}.gpu_class", w.get("gpu_class"), "name")
        if gclass is not None and classes and gclass not in classes:
            e.add(f"{where}.gpu_class", f"unknown GPU class {show_value(gclass)} (defined: {', '.join(classes) or 'none'})")
        gpus = check_value(e, f"{where}.gpus", w.get("gpus", 1), "positive_int")
        warm = check_value(e, f"{where}.warm_pool", w.get("warm_pool", False), "bool")
        caps: dict[str, Any] = {}
        for f, kind in CAPABILITY_FIELDS:
            if f in w:
                caps[f] = check_value(e, f"{where}.{f}", w[f], kind)
            elif gclass in classes and f in classes[gclass]:
                caps[f] = classes[gclass][f]
        if len(e.lines) > problems_before:
            continue
        workers.append(WorkerTopo(name=name, node=node, nvlink_domain=domain, gpu_class=gclass, gpus=gpus,
                                  warm_pool=warm, **caps))
    e.raise_if_any(TopologyError)
    return Topology(model=model, block_size=block_size, workers=tuple(workers), downgrade_model=downgrade,
                    kv_bytes_per_token=kv_bytes, source=source)


def load_topology(path: str | Path) -> Topology:
    """Load and validate a topology file."""
    p = Path(path)
    return parse_topology(load_yaml_mapping(p, TopologyError), p.name)
