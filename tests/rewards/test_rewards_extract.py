import pytest

from anchor_rl.rewards.extract import extract_answer, extract_boxed, extract_tag


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<answer>1</answer> then <answer> 2 </answer>", "2"),
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{a{b{c}}d}", "a{b{c}}d"),
        ("\\boxed{1} and then \\boxed{2", "1"),  # the unclosed box is skipped
        ("<answer>\\boxed{3}</answer>", "3"),
        ("<answer>4</answer> \\boxed{5}", "4"),  # the answer block wins over a box
        ("\\fbox{6}", "6"),
        ("no answer here", None),
        ("<answer>unclosed", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_tag_uses_the_last_open_before_the_last_close():
    assert extract_tag("<search>a <search>b</search>", "search") == "b"
    assert extract_tag("</search>", "search") is None


def test_extract_boxed_none_without_box():
    assert extract_boxed("{1}") is None
