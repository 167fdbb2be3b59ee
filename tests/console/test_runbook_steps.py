"""The first runbook step the evidence fits, and what was checked to choose it (pure)."""

from __future__ import annotations

from pathlib import Path

from console.runbook_steps import Evidence, PoolChange, first_fitting, mitigation_steps

RUNBOOKS = Path(__file__).resolve().parents[2] / "runbooks"
STICKY = (RUNBOOKS / "PrefixStickyCollisionsHigh.md").read_text(encoding="utf-8")
WALK = (RUNBOOKS / "PrefixRouterTreeWalkSlow.md").read_text(encoding="utf-8")


def test_re_keyed_sessions_behind_a_consistent_hash_router_skip_the_hash_mod_step() -> None:
    # 8 → 9 workers moved 11% of sessions (about 1/9): the ring already moves only what it must.
    e = Evidence(pool_changes=(PoolChange(100.0, 8, 9, 0.11),), rekeys=42)
    advice = first_fitting("PrefixStickyCollisionsHigh", STICKY, e)
    assert advice is not None and advice.number == 2 and advice.text.startswith("Re-keys:")
    assert advice.reason() == ("the last pool change reshuffled 11.0% of sessions (about 1/9: the router already "
                               "moves only the keys that must move), so not step 1; 42 sessions re-keyed in the window")


def test_a_hash_mod_reshuffle_is_step_one() -> None:
    e = Evidence(pool_changes=(PoolChange(100.0, 8, 9, 0.86),), rekeys=0)
    advice = first_fitting("PrefixStickyCollisionsHigh", STICKY, e)
    assert advice is not None and advice.number == 1 and "86.0% of sessions" in advice.reason()


def test_without_a_pool_change_or_re_keys_the_next_step_stands() -> None:
    advice = first_fitting("PrefixStickyCollisionsHigh", STICKY, Evidence(pool_changes=(), rekeys=0))
    assert advice is not None and advice.number == 3 and advice.checked is None
    assert advice.skipped == ("no pool change in the window, so not step 1", "no session re-keyed in the window, so not step 2")


def test_unknown_evidence_keeps_the_runbooks_order_and_says_so() -> None:
    advice = first_fitting("PrefixStickyCollisionsHigh", STICKY, Evidence())
    assert advice is not None and advice.number == 1 and advice.checked == "pool changes unknown (the exporter did not say)"


def test_steps_join_their_wrapped_lines_and_stop_at_the_next_heading() -> None:
    md = "# X\n## Mitigation\n1. Roll back\n   the change.\n2. Wait.\n\nA closing note.\n## Next\n1. no\n"
    assert mitigation_steps(md) == ["Roll back the change.", "Wait."]
    assert mitigation_steps("# X\n## Mitigation\nDo this first.\nAnd this.\n\nLater.\n") == ["Do this first. And this."]


def test_a_small_router_tree_is_not_the_slow_walks_cause() -> None:
    advice = first_fitting("PrefixRouterTreeWalkSlow", WALK,
                           Evidence(router_tree_fill=0.02, breaching=frozenset({"prefix_tree_depth_p99"})))
    assert advice is not None and advice.number == 2 and advice.text.startswith("Tree too deep")
    assert advice.skipped == ("the router's largest prefix tree is at 2.0% of its --max-tree-size, so not step 1",)


def test_a_router_tree_near_its_bound_is_step_one_and_an_unreported_one_keeps_the_order() -> None:
    full = first_fitting("PrefixRouterTreeWalkSlow", WALK, Evidence(router_tree_fill=0.93))
    assert full is not None and full.number == 1 and "93.0% of its --max-tree-size" in full.reason()
    unknown = first_fitting("PrefixRouterTreeWalkSlow", WALK, Evidence())
    assert unknown is not None and unknown.number == 1 and "tree size unknown" in unknown.reason()
