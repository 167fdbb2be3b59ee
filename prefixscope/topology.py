"""The topology file format: which workers exist, where they sit and what they can do.

A topology file (YAML, ``prefixscope.topology/v1``, documented in docs/topology.md) names
the model and the workers with their node, NVLink domain, GPU class, GPU count and warm-pool
membership — the placement fields, required, and all the exporter reads besides the optional
``kv_blocks`` (capacity when the engine does not say), ``price_per_gpu_hour`` (cold-prefill
cost) and ``max_concurrency`` (warm-pool utilisation). GPU classes may carry a capability
vector (seed §4: prefill_tps, decode_tps, intra-/inter-node bandwidth) that only the simulator
needs; :meth:`Topology.require_simulator_fields` says what a file lacks for it. A worker may
override any class field.

Validation (``prefixscope/schemas/topology.v1.json``, then the checks that span workers: unique
names, an NVLink domain within one node, GPU classes defined) collects every problem and raises
:class:`TopologyError` whose message names the file, the field and the problem, e.g.
``default.yaml: workers[3].prefill_tps: expected a positive number, got "fast"``.

Service discovery places workers too: a discovered worker's labels (``node``, ``nvlink_domain``,
``gpu_class``, ``gpus``, ``warm_pool``) make it an entry of the topology the exporter judges
placement by (:func:`with_discovered`). A worker the file names keeps the file's entry whole; the
labels place the workers the file does not name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prefixscope.validation import InvalidFile, Problems, read_yaml, show

SCHEMA = "prefixscope.topology/v1"

SCHEMA_FILE = "topology.v1.json"

# Capability fields a GPU class defines and a worker may override (their types: the schema).
CAPABILITY_FIELDS = ("prefill_tps", "decode_tps", "kv_blocks", "intra_node_gbps", "inter_node_gbps",
                     "price_per_gpu_hour", "max_concurrency")
INTEGER_FIELDS = frozenset({"kv_blocks", "max_concurrency"})
# What only the simulator needs: a real cluster's topology file may leave these out.
SIMULATOR_FIELDS = ("prefill_tps", "decode_tps", "kv_blocks", "intra_node_gbps", "inter_node_gbps")


class TopologyError(InvalidFile):
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
    router_metrics: str | None = None  # simulator only: the reference router's /metrics flavour
    # GPU class -> its capabilities as the file defines them ((field, value) pairs): what a worker
    # that only discovery places inherits from the class its labels name
    gpu_classes: tuple[tuple[str, tuple[tuple[str, float], ...]], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {w.name: w for w in self.workers})

    def class_capabilities(self, gpu_class: str) -> dict[str, float]:
        """The capabilities the file's ``gpu_classes`` give ``gpu_class`` (none for a class it lacks)."""
        return next((dict(caps) for name, caps in self.gpu_classes if name == gpu_class), {})

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
        if self.router_metrics:
            data["router_metrics"] = self.router_metrics
        return data


# --------------------------------------------------------------------------------------
# Validation: the schema (schemas/topology.v1.json), then what spans entries
# --------------------------------------------------------------------------------------
def _placement_problems(problems: Problems, data: Mapping[str, Any]) -> None:
    """Unique names, NVLink domains within one node, GPU classes defined (when any are)."""
    workers = data.get("workers") if isinstance(data.get("workers"), list) else []
    classes = data.get("gpu_classes") if isinstance(data.get("gpu_classes"), Mapping) else {}
    seen: set[str] = set()
    domain_node: dict[str, tuple[str, int]] = {}
    for i, w in enumerate(workers):
        if not isinstance(w, Mapping):
            continue
        where = f"workers[{i}]"
        name, node, domain, gclass = (w.get(k) for k in ("name", "node", "nvlink_domain", "gpu_class"))
        if isinstance(name, str):
            if name in seen:
                problems.add(f"{where}.name", f"duplicate worker name {show(name)}")
            seen.add(name)
        if isinstance(domain, str) and isinstance(node, str):
            prev = domain_node.setdefault(domain, (node, i))
            if prev[0] != node:
                problems.add(f"{where}.nvlink_domain", f"domain {show(domain)} is on node {show(prev[0])} "
                             f"(workers[{prev[1]}]); an NVLink domain cannot span nodes")
        if isinstance(gclass, str) and classes and gclass not in classes:
            problems.add(f"{where}.gpu_class", f"unknown GPU class {show(gclass)} (defined: {', '.join(map(str, classes))})")


def _worker(w: Mapping[str, Any], classes: Mapping[str, Mapping[str, Any]]) -> WorkerTopo:
    """A validated worker entry, its missing capabilities taken from its GPU class."""
    caps = _capabilities({**classes.get(w["gpu_class"], {}), **w})
    return WorkerTopo(name=w["name"], node=w["node"], nvlink_domain=w["nvlink_domain"], gpu_class=w["gpu_class"],
                      gpus=int(w.get("gpus", 1)), warm_pool=w.get("warm_pool", False), **caps)


def parse_topology(data: Mapping[str, Any], source: str = "<topology>") -> Topology:
    """Validate plain data (a parsed topology file) into a :class:`Topology`; every problem at once."""
    problems = Problems(source)
    problems.check_schema(data, SCHEMA_FILE)
    if isinstance(data, Mapping):
        _placement_problems(problems, data)
    problems.raise_if_any(TopologyError)
    classes = data.get("gpu_classes") or {}
    return Topology(model=data["model"], block_size=int(data.get("block_size", 16)),
                    workers=tuple(_worker(w, classes) for w in data["workers"]),
                    downgrade_model=data.get("downgrade_model"),
                    kv_bytes_per_token=int(data.get("kv_bytes_per_token", 131072)), source=source,
                    router_metrics=data.get("router_metrics"),
                    gpu_classes=tuple((name, tuple(_capabilities(caps).items())) for name, caps in classes.items()))


def _capabilities(fields: Mapping[str, Any]) -> dict[str, float]:
    return {f: int(fields[f]) if f in INTEGER_FIELDS else float(fields[f]) for f in CAPABILITY_FIELDS if f in fields}


# --------------------------------------------------------------------------------------
# Workers that service discovery places
# --------------------------------------------------------------------------------------
# The target labels that place a discovered worker (docs/operating.md, "Following a fleet that scales").
DISCOVERED_FIELDS = ("node", "nvlink_domain", "gpu_class", "gpus", "warm_pool")
DISCOVERED_SOURCE = "discovery"  # the topology's source when no file is loaded
UNKNOWN_CLASS = "unknown"


def _discovered_worker(name: str, labels: Mapping[str, str], base: Topology | None) -> WorkerTopo:
    """A worker placed by its labels; a label that cannot be a topology field raises ValueError."""
    node = labels.get("node")
    if not node:
        raise ValueError("no node label (the other topology labels place a worker only with its node)")
    gpus = labels.get("gpus", "1")
    if not gpus.isdigit() or int(gpus) < 1:
        raise ValueError(f"gpus {show(gpus)} is not a positive integer")
    warm = labels.get("warm_pool", "false").lower()
    if warm not in ("true", "false"):
        raise ValueError(f"warm_pool {show(labels['warm_pool'])} is not true or false")
    gpu_class = labels.get("gpu_class") or UNKNOWN_CLASS
    caps = base.class_capabilities(gpu_class) if base is not None else {}
    return WorkerTopo(name=name, node=node, nvlink_domain=labels.get("nvlink_domain") or node, gpu_class=gpu_class,
                      gpus=int(gpus), warm_pool=warm == "true", **caps)  # type: ignore[arg-type]


def with_discovered(base: Topology | None, labels: Mapping[str, Mapping[str, str]]
                    ) -> tuple[Topology | None, dict[str, str]]:
    """The topology placement is judged by: the file's (``base``; None without one) and the
    discovered workers its labels place (``labels``: worker -> its topology labels, in discovery
    order), and per worker whose labels could not be used, why.

    Precedence: a worker the file names keeps its file entry whole (the file is the operator's
    word, as a ``workers:`` entry wins a name clash in discovery); the labels place only the
    workers the file does not name. Without ``nvlink_domain`` a worker's domain is its node;
    without ``gpu_class`` its class is ``unknown``; ``gpus`` defaults to 1 and ``warm_pool`` to
    false. A label worker inherits the capabilities of the file's ``gpu_classes`` entry its class
    names. A worker without a ``node`` label, with a malformed ``gpus`` or ``warm_pool``, or in a
    domain the file or an earlier worker puts on another node is left out (and named).
    Returns ``base`` itself when no label places a worker.
    """
    workers = list(base.workers) if base is not None else []
    named = {w.name for w in workers}
    domain_node = {w.nvlink_domain: w.node for w in workers}
    problems: dict[str, str] = {}
    for name, fields in labels.items():
        if name in named or not any(fields.get(f) for f in DISCOVERED_FIELDS):
            continue
        try:
            w = _discovered_worker(name, fields, base)
        except ValueError as exc:
            problems[name] = str(exc)
            continue
        on = domain_node.setdefault(w.nvlink_domain, w.node)
        if on != w.node:
            problems[name] = (f"nvlink_domain {show(w.nvlink_domain)} is on node {show(on)}, not {show(w.node)}; "
                              "an NVLink domain cannot span nodes")
            continue
        workers.append(w)
        named.add(name)
    if base is not None and len(workers) == len(base.workers):
        return base, problems
    if not workers:
        return None, problems
    if base is None:  # no file: what only a file says (model, block size) is unknown
        return Topology(model="", block_size=0, workers=tuple(workers), source=DISCOVERED_SOURCE), problems
    return replace(base, workers=tuple(workers)), problems


def load_topology(path: str | Path) -> Topology:
    """Load and validate a topology file."""
    p = Path(path)
    return parse_topology(read_yaml(p, p.name, TopologyError), p.name)
