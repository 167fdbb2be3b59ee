"""Workers placed by their discovery labels, combined with a topology file (``with_discovered``)."""

from __future__ import annotations

from prefixscope.topology import Topology, parse_topology, with_discovered

FILE = parse_topology({
    "schema": "prefixscope.topology/v1", "model": "m", "block_size": 16,
    "gpu_classes": {"H100": {"kv_blocks": 4000, "price_per_gpu_hour": 2.5}, "A100": {"kv_blocks": 2000}},
    "workers": [{"name": "w0", "node": "n1", "nvlink_domain": "n1-a", "gpu_class": "H100", "warm_pool": True}],
}, "topology.yaml")


def test_labels_place_the_workers_the_file_does_not_name() -> None:
    topo, problems = with_discovered(FILE, {
        "pod-1": {"node": "n2", "nvlink_domain": "n2-a", "gpu_class": "A100", "gpus": "2", "warm_pool": "true"},
        "pod-2": {"node": "n3"},
        "pod-3": {},  # no topology labels: a worker, not placed
    })
    assert problems == {}
    assert topo is not None and topo.names == ("w0", "pod-1", "pod-2")
    p1, p2 = topo.worker("pod-1"), topo.worker("pod-2")
    assert (p1.node, p1.nvlink_domain, p1.gpu_class, p1.gpus, p1.warm_pool) == ("n2", "n2-a", "A100", 2, True)
    assert p1.kv_blocks == 2000  # its class, as the file defines it
    assert (p2.nvlink_domain, p2.gpu_class, p2.gpus, p2.warm_pool, p2.kv_blocks) == ("n3", "unknown", 1, False, None)
    assert topo.warm_pool == ("w0", "pod-1")
    assert (topo.model, topo.block_size) == ("m", 16)  # the file's


def test_the_file_entry_wins_for_a_worker_it_names() -> None:
    topo, problems = with_discovered(FILE, {"w0": {"node": "elsewhere", "gpu_class": "A100"}})
    assert topo is FILE and problems == {}
    assert topo.worker("w0").node == "n1"


def test_without_a_file_the_labels_alone_place_the_workers() -> None:
    topo, _ = with_discovered(None, {"a": {"node": "n1"}, "b": {"node": "n1", "nvlink_domain": "n1"}})
    assert isinstance(topo, Topology)
    assert topo.names == ("a", "b") and topo.domain_of("a") == topo.domain_of("b") == "n1"
    assert (topo.model, topo.block_size) == ("", 0)  # unknown: only a file says them
    assert with_discovered(None, {"a": {}}) == (None, {})


def test_labels_that_cannot_place_a_worker_leave_it_out_and_say_why() -> None:
    topo, problems = with_discovered(FILE, {
        "no-node": {"gpu_class": "H100"},
        "bad-gpus": {"node": "n2", "gpus": "two"},
        "bad-warm": {"node": "n2", "warm_pool": "yes"},
        "spans": {"node": "n9", "nvlink_domain": "n1-a"},  # the file puts n1-a on n1
        "ok": {"node": "n2"},
    })
    assert topo is not None and topo.names == ("w0", "ok")
    assert set(problems) == {"no-node", "bad-gpus", "bad-warm", "spans"}
    assert "no node label" in problems["no-node"]
    assert 'gpus "two"' in problems["bad-gpus"]
    assert 'warm_pool "yes"' in problems["bad-warm"]
    assert 'nvlink_domain "n1-a" is on node "n1"' in problems["spans"]
