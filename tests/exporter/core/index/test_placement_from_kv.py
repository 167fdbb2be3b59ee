"""Topology-aware placement judged from KV events on the index (both implementations).

The rule (``exporter.core.index.prefix_index_ref``'s docstring): each GPU ``BlockStored`` on worker w is one
placement judged against the index before it — the workers holding the longest prefix are the
deepest non-empty intersection of the other holders of b1, b2, …, else the holders of the parent;
a domain hit when w's NVLink domain holds one of them. With the batches' clock set, a store that
continues a chain the worker stored within ``PLACEMENT_CONTINUATION_S`` is the same request going
on (chunked prefill, decode blocks), not a placement.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.core.index.prefix_index import ReferencePrefixIndex
from exporter.core.index.prefix_index_ref import ChainTails
from exporter.model import BlockRemoved, BlockStored
from prefixscope.catalog import PLACEMENT_CONTINUATION_S
from tests.exporter.core.index.test_prefix_index_equality import batches, forests, observe, payload

compiled = pytest.importorskip("exporter.core.index._prefix_core")
CompiledPrefixIndex = compiled.CompiledPrefixIndex
CLASSES = [ReferencePrefixIndex, CompiledPrefixIndex]
# w0 and w1 share an NVLink domain, w2 has its own; w9 is not in the topology
DOMAINS = {"w0": "node-a/nvl0", "w1": "node-a/nvl0", "w2": "node-b/nvl0"}


def judged(idx, worker: str, *events) -> tuple[int, int]:
    res = idx.apply(worker, list(events))
    return res.placements, res.placement_hits


def index(cls, domains=DOMAINS):
    idx = cls()
    idx.set_placement_domains(domains)
    return idx


@pytest.mark.parametrize("cls", CLASSES)
def test_a_first_store_of_a_prefix_nobody_holds_is_no_placement(cls) -> None:
    idx = index(cls)
    assert judged(idx, "w0", BlockStored((1, 2, 3), None, 16)) == (0, 0)


@pytest.mark.parametrize("cls", CLASSES)
def test_without_a_clock_a_store_under_its_own_prefix_is_an_in_domain_placement(cls) -> None:
    idx = index(cls)
    idx.apply("w2", [BlockStored((1, 2), None, 16)])
    assert judged(idx, "w2", BlockStored((3, 4), 2, 16)) == (1, 1)


@pytest.mark.parametrize("cls", CLASSES)
def test_recomputing_a_prefix_held_in_another_domain_is_a_miss(cls) -> None:
    idx = index(cls)
    idx.apply("w2", [BlockStored((1, 2, 3), None, 16)])
    assert judged(idx, "w0", BlockStored((1, 2, 3, 4), None, 16)) == (1, 0)
    # w0 now holds it too: w1 recomputing it is in w0's domain
    assert judged(idx, "w1", BlockStored((1, 2, 3, 5), None, 16)) == (1, 1)


def at(idx, ts: float, worker: str, *events) -> tuple[int, int]:
    idx.set_placement_clock(ts)
    return judged(idx, worker, *events)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_request_as_vllm_stores_it_is_one_placement(cls) -> None:
    """A prompt in two chunks, then its output a block at a time: one judgement, at the first store."""
    idx = index(cls)
    at(idx, 0.0, "w2", BlockStored((1, 2), None, 16))  # an earlier request left the system prompt on w2
    assert at(idx, 10.0, "w0", BlockStored((1, 2, 3, 4), None, 16)) == (1, 0)  # chunk 1: w2 held it
    assert at(idx, 10.2, "w0", BlockStored((5, 6), 4, 16)) == (0, 0)  # chunk 2
    for i in range(10):  # decode: a block every 0.5 s, each under the last
        assert at(idx, 10.7 + 0.5 * i, "w0", BlockStored((100 + i,), 6 if i == 0 else 99 + i, 16)) == (0, 0)
    # the next turn of the conversation, a while later on the same worker: a placement, in domain
    assert at(idx, 30.0, "w0", BlockStored((200, 201), 109, 16)) == (1, 1)
    # another turn sent to a worker in another domain straight after: judged there — a miss
    assert at(idx, 30.5, "w2", BlockStored((200, 202), 109, 16)) == (1, 0)


@pytest.mark.parametrize("cls", CLASSES)
def test_a_continuation_is_judged_only_within_the_window(cls) -> None:
    idx = index(cls)
    at(idx, 0.0, "w1", BlockStored((1, 2), None, 16))
    assert at(idx, PLACEMENT_CONTINUATION_S, "w1", BlockStored((3,), 2, 16)) == (0, 0)  # at the edge: continues
    assert at(idx, 2 * PLACEMENT_CONTINUATION_S + 0.1, "w1", BlockStored((4,), 3, 16)) == (1, 1)  # past it
    # another worker's tail is no continuation of this one's
    assert at(idx, 2 * PLACEMENT_CONTINUATION_S + 0.2, "w0", BlockStored((5,), 4, 16)) == (1, 1)


def test_chain_tails_prune_only_what_is_past_the_window() -> None:
    tails = ChainTails(window=2.0)
    for i in range(1000):  # a busy worker: a chain every 10 ms
        tails.now = i * 0.01
        assert not tails.continues(0, None, i)
    tails.now = 10.0
    assert tails.continues(0, 999, 5000) and tails.continues(0, 801, 5001)  # 8.01 s: within 2 s of 10
    assert not tails.continues(0, 700, 5002)  # 7.0 s: past the window
    assert len(tails._tails[0]) < 600  # old tails pruned as the map doubled


@pytest.mark.parametrize("cls", CLASSES)
def test_the_longest_prefix_wins_over_a_shorter_one_in_the_domain(cls) -> None:
    idx = index(cls)
    idx.apply("w1", [BlockStored((1, 2), None, 16)])  # in w0's domain, but shorter
    idx.apply("w2", [BlockStored((1, 2, 3, 4), None, 16)])  # the longest, in another domain
    assert judged(idx, "w0", BlockStored((1, 2, 3, 4, 5), None, 16)) == (1, 0)
    # a worker holding its parent while another domain held the chain further: still a miss
    idx.apply("w0", [BlockRemoved((3, 4, 5))])
    assert judged(idx, "w0", BlockStored((3, 6), 2, 16)) == (1, 0)


@pytest.mark.parametrize("cls", CLASSES)
def test_holders_of_the_parent_count_when_the_worker_lost_it(cls) -> None:
    idx = index(cls)
    idx.apply("w1", [BlockStored((1, 2), None, 16)])
    # w0 never held 2 (its view lost it): the prefix up to 2 was on w1, in its domain
    assert judged(idx, "w0", BlockStored((3,), 2, 16)) == (1, 1)
    idx.apply("w2", [BlockStored((7, 8), None, 16)])
    assert judged(idx, "w0", BlockStored((9,), 8, 16)) == (1, 0)
    assert judged(idx, "w0", BlockStored((10,), 12345, 16)) == (0, 0)  # nobody holds the parent


@pytest.mark.parametrize("cls", CLASSES)
def test_other_tiers_and_workers_outside_the_topology(cls) -> None:
    idx = index(cls)
    idx.apply("w2", [BlockStored((1, 2), None, 16, medium="CPU")])  # holders count on any tier
    assert judged(idx, "w0", BlockStored((1, 2), None, 16, medium="CPU")) == (0, 0)  # only GPU stores are judged
    assert judged(idx, "w0", BlockStored((1, 2, 3), None, 16, medium=None)) == (1, 0)  # None is the GPU
    assert judged(idx, "w9", BlockStored((1, 2, 4), None, 16)) == (0, 0)  # not in the topology: not judged
    idx.apply("w9", [BlockStored((5,), None, 16)])
    assert judged(idx, "w1", BlockStored((5, 6), None, 16)) == (1, 0)  # held only outside any domain


@pytest.mark.parametrize("cls", CLASSES)
def test_excluded_workers_hold_nothing_a_placement_could_use(cls) -> None:
    idx = index(cls)
    idx.apply("w2", [BlockStored((1, 2), None, 16)])
    idx.set_placement_excluded({"w2"})
    assert judged(idx, "w0", BlockStored((1, 2, 3), None, 16)) == (0, 0)
    idx.set_placement_excluded(set())
    assert judged(idx, "w1", BlockStored((1, 2, 4), None, 16)) == (1, 1)  # w0 holds 1-2 now


@pytest.mark.parametrize("cls", CLASSES)
def test_without_domains_nothing_is_judged(cls) -> None:
    idx = cls()
    idx.apply("w2", [BlockStored((1, 2), None, 16)])
    assert judged(idx, "w0", BlockStored((1, 2, 3), None, 16)) == (0, 0)
    idx.set_placement_domains(DOMAINS)
    assert judged(idx, "w1", BlockStored((1, 2, 4), None, 16)) == (1, 1)
    idx.set_placement_domains(None)
    assert judged(idx, "w2", BlockStored((1, 2, 5), None, 16)) == (0, 0)


def test_many_workers_intersect_alike() -> None:
    # 40 workers holding a shared chain to random depths, in two domains: every store's judgement agrees
    import random

    rng = random.Random(3)
    domains = {f"w{i}": f"d{i % 2}" for i in range(40)}
    ref, comp = index(ReferencePrefixIndex, domains), index(CompiledPrefixIndex, domains)
    chain = tuple(range(1, 9))
    placements = hits = 0
    for step in range(200):
        w = f"w{rng.randrange(42)}"  # w40, w41: outside the topology
        i = rng.randrange(len(chain))
        if rng.random() < 0.3:
            events = [BlockRemoved(chain[i:i + rng.randint(1, 3)])]
        else:
            events = [BlockStored(chain[i:rng.randint(i + 1, len(chain))], chain[i - 1] if i else None, 16)]
        if step % 50 == 0:
            out = {f"w{rng.randrange(40)}" for _ in range(5)}
            ref.set_placement_excluded(out)
            comp.set_placement_excluded(out)
        want = ref.apply(w, events)
        assert comp.apply(w, events) == want
        placements, hits = placements + want.placements, hits + want.placement_hits
    assert 0 < hits < placements


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_compiled_decoded_and_scanned_judge_as_the_reference(data: st.DataObject) -> None:
    paths = data.draw(forests())
    domains = {w: d for w, d in zip(("w0", "w1", "w2"), data.draw(st.lists(st.sampled_from(("a", "b", None)),
                                                                          min_size=3, max_size=3)), strict=True)
               if d is not None}
    ref, comp, scanned = ReferencePrefixIndex(), CompiledPrefixIndex(), CompiledPrefixIndex()
    arrays = data.draw(st.booleans())
    clock = data.draw(st.booleans())  # with the batches' clock, continuations are left out
    judging, ts = False, 0.0
    for _ in range(data.draw(st.integers(1, 25))):
        if data.draw(st.integers(0, 4)) == 0:  # domains and exclusions change between batches
            judging = data.draw(st.booleans())
            excluded = set(data.draw(st.lists(st.sampled_from(("w0", "w1", "w2")), max_size=2)))
            for idx in (ref, comp, scanned):
                idx.set_placement_domains(domains if judging else None)
                idx.set_placement_excluded(excluded)
        worker, events, restart = data.draw(batches(paths))
        if clock:  # steps around the window, now and then back in time (an engine's clock reset)
            ts += data.draw(st.sampled_from((0.0, 0.5, PLACEMENT_CONTINUATION_S, 2.5, -1.0)))
            for idx in (ref, comp, scanned):
                idx.set_placement_clock(ts)
        want = ref.apply(worker, events)
        assert comp.apply(worker, events) == want
        scan = compiled.scan_kv_batch(payload(events, arrays))
        assert scan is not None and scanned.apply_scan(worker, scan) == want
        if not judging:
            assert want.placements == want.placement_hits == 0
        if restart:
            for idx in (ref, comp, scanned):
                idx.clear_worker(worker)
    assert observe(ref, paths) == observe(comp, paths) == observe(scanned, paths)
