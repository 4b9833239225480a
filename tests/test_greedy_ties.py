"""tests/greedy_ties.py: which first differences count as a bf16 tie."""

from __future__ import annotations

from tests.greedy_ties import NEAR_TIE_NATS, first_difference_is_a_tie

SAME_START = [5, 6]
TOP_SAME_START = [{5: -0.1, 9: -3.0}, {6: -0.2, 9: -2.5}]


def test_picks_within_the_margin_of_each_other_on_both_sides_are_a_tie() -> None:
    a = SAME_START + [7, 1]
    b = SAME_START + [8, 2]  # after the tie the contexts differ: later tokens do not matter
    a_top = TOP_SAME_START + [{7: -0.69, 8: -0.70}, {1: -0.1, 3: -4.0}]
    b_top = TOP_SAME_START + [{8: -0.68, 7: -0.71}, {2: -0.1, 4: -4.0}]
    assert first_difference_is_a_tie(a, a_top, b, b_top)


def test_a_gap_wider_than_the_margin_on_either_side_is_a_real_difference() -> None:
    a, b = SAME_START + [7], SAME_START + [8]
    wide = -0.69 - NEAR_TIE_NATS - 0.01
    close = TOP_SAME_START + [{8: -0.68, 7: -0.71}]
    assert not first_difference_is_a_tie(a, TOP_SAME_START + [{7: -0.69, 8: wide}], b, close)
    assert not first_difference_is_a_tie(b, close, a, TOP_SAME_START + [{7: -0.69, 8: wide}])


def test_a_pick_missing_from_the_other_sides_candidates_is_a_real_difference() -> None:
    a, b = SAME_START + [7], SAME_START + [8]
    assert not first_difference_is_a_tie(
        a, TOP_SAME_START + [{7: -0.5, 3: -0.55}], b, TOP_SAME_START + [{8: -0.5, 7: -0.55}]
    )


def test_equal_tokens_or_missing_logprobs_are_not_a_tie() -> None:
    same = SAME_START + [7]
    top = TOP_SAME_START + [{7: -0.1, 8: -0.15}]
    assert not first_difference_is_a_tie(same, top, same, top)
    assert not first_difference_is_a_tie(same, [], SAME_START + [8], top)
