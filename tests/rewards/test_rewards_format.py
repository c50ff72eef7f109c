import pytest

from anchor_rl.rewards.format import format_ok, format_score


@pytest.mark.parametrize(
    ("text", "ok"),
    [
        ("<think>x</think><answer>5</answer>", True),
        ("<answer>5</answer>", True),
        ("Let me think. <answer>a</answer>\n", True),
        ("<search>q</search><result>d</result><answer>a</answer>", True),
        ("<search>q</search> <result>d</result><think>t</think><answer>a</answer>", True),
        ("<answer>5</answer> trailing", False),
        ("<answer>5</answer><answer>6</answer>", False),
        ("<answer> </answer>", False),
        ("<think><answer>5</answer></think>", False),
        ("<think>x<answer>5</answer>", False),
        ("<search>q</search>text<result>d</result><answer>a</answer>", False),
        ("<result>d</result><answer>a</answer>", False),
        ("<search>q</search><answer>a</answer>", False),
        ("<search>q</search><result>d</result><search>r</search><answer>a</answer>", False),
        ("<answer>5", False),
        ("</think><answer>5</answer>", False),
        ("", False),
    ],
)
def test_format_ok(text, ok):
    assert format_ok(text) is ok
    assert format_score(text) == float(ok)


def test_only_named_tools_are_tags():
    text = "<lookup>q</lookup><answer>a</answer>"
    assert format_ok(text)  # unknown tags are plain text
    assert not format_ok(text, tools=("lookup",))  # a call with no result
    assert format_ok("<lookup>q</lookup><result>r</result><answer>a</answer>", tools=("lookup",))
