import pytest
from hypothesis import given
from hypothesis import strategies as st

from anchor_rl.rewards.qa import cover_exact_match, exact_match, f1, normalize_answer


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        ("The  Eiffel-Tower!", "eiffeltower"),
        ("An apple a day", "apple day"),
        ("  Hello,   World. ", "hello world"),
        ("theater", "theater"),  # articles only as whole words
        ("", ""),
    ],
)
def test_normalize_answer(raw, normalised):
    assert normalize_answer(raw) == normalised


def test_exact_match():
    assert exact_match("the Paris", "Paris") == 1.0
    assert exact_match("Paris, France", "Paris") == 0.0
    assert exact_match("NYC", ["New York City", "NYC"]) == 1.0
    assert exact_match("Boston", ["New York City", "NYC"]) == 0.0


def test_f1_hand_examples():
    # pred tokens [cat, sat, on, mat], gold [cat, on, mat]: P = 3/4, R = 1 -> F1 = 6/7
    assert f1("the cat sat on mat", "cat on the mat") == pytest.approx(6 / 7)
    # multiplicity: [x, x, y] vs [x, y, y] share x once and y once: P = R = 2/3
    assert f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert f1("blue", "red") == 0.0
    assert f1("the", "a") == 1.0  # both normalise to nothing
    assert f1("", "x") == 0.0
    assert f1("red car", ["blue", "red car"]) == 1.0


def test_cover_exact_match():
    assert cover_exact_match("It was Paris, France.", "paris") == 1.0
    assert cover_exact_match("parisian", "paris") == 0.0
    assert cover_exact_match("in new york city", "York City") == 1.0
    assert cover_exact_match("city york", "york city") == 0.0
    assert cover_exact_match("anything", "the") == 0.0  # empty gold covers nothing
    assert cover_exact_match("rome", ["Paris", "Rome"]) == 1.0


def test_empty_gold_list_is_an_error():
    with pytest.raises(ValueError, match="no gold"):
        exact_match("x", [])


@given(st.text(max_size=30), st.text(max_size=30))
def test_scores_are_bounded_and_em_implies_the_others(pred, gold):
    em, score, cem = exact_match(pred, gold), f1(pred, gold), cover_exact_match(pred, gold)
    assert 0.0 <= score <= 1.0
    if em == 1.0:
        assert score == 1.0
        assert cem == (1.0 if normalize_answer(gold) else 0.0)
