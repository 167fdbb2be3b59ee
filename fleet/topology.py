"""The simulated fleet's topology: the file format of :mod:`prefixscope.topology`, with the
simulator's own needs on top — the default fleet, and every capability field present."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from prefixscope.topology import (
    SCHEMA,
    Topology,
    TopologyError,
    WorkerTopo,
    parse_topology,
)
from prefixscope.topology import (
    load_topology as _load_file,
)

DEFAULT_TOPOLOGY = Path(__file__).resolve().parent / "topologies" / "default.yaml"
DEFAULT_MAX_CONCURRENCY = 256  # vLLM's default max_num_seqs


def for_simulation(topology: Topology) -> Topology:
    """The topology with every simulator field checked present (``TopologyError`` lists gaps)."""
    topology.require_simulator_fields()
    return replace(topology, workers=tuple(
        w if w.max_concurrency is not None else replace(w, max_concurrency=DEFAULT_MAX_CONCURRENCY)
        for w in topology.workers))


def load_topology(path: str | Path | None = None) -> Topology:
    """Load a topology for the simulator (the default fleet when ``path`` is None)."""
    return for_simulation(_load_file(path if path is not None else DEFAULT_TOPOLOGY))


__all__ = ["DEFAULT_TOPOLOGY", "SCHEMA", "Topology", "TopologyError", "WorkerTopo", "for_simulation",
           "load_topology", "parse_topology"]
