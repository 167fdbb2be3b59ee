"""The console's reading of a check's culprits: the near-duplicate pair of prefix instability."""

from console.culprits import parse_culprits


def test_a_near_duplicate_pair_is_one_line_with_where_the_two_differ() -> None:
    raw = {"workers": [], "prefixes": [], "sessions": [], "nodes": [],
           "near_duplicates": [{"new_root": "9c41d2e0", "recent_root": "3f2a9c01", "worker": "w3", "at": 5.0,
                                "span_offset": 6, "span_length": 9, "new_token_ids": [48, 56, 58],
                                "recent_token_ids": [48, 56, 58], "new_text": "08:05:03.512730",
                                "recent_text": None}]}
    c = parse_culprits(raw)
    assert c is not None and c.lines() == [
        "**Near-duplicate prefixes**: new root `9c41d2e0` “08:05:03.512730” repeats recent root `3f2a9c01` "
        "tokens 48 56 58 but for tokens 7–15 (9 tokens)"]


def test_without_prefix_text_the_pair_shows_roots_and_span_only() -> None:
    c = parse_culprits({"near_duplicates": [{"new_root": "9c41d2e0", "recent_root": "3f2a9c01", "span_offset": 0,
                                             "span_length": 16, "new_token_ids": None, "recent_token_ids": None}]})
    assert c is not None and c.lines() == [
        "**Near-duplicate prefixes**: new root `9c41d2e0` repeats recent root `3f2a9c01` but for tokens 1–16 (16 tokens)"]


def test_a_malformed_pair_is_left_out() -> None:
    c = parse_culprits({"near_duplicates": [{"new_root": "a"}, "x"]})
    assert c is not None and c.near_duplicates == () and c.lines() == []
