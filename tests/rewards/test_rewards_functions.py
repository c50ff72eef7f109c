import pytest

from anchor_rl.rewards import (
    REWARD_FUNCTIONS,
    format_reward,
    get_reward_function,
    math_reward,
    pvpo_reward,
    qa_cem_reward,
    qa_em_reward,
    qa_f1_reward,
)


def test_qa_rewards_read_the_answer_column():
    completions = ["<answer>Paris</answer>", "<answer>Rome city</answer>", "no tags", "x"]
    answer = ["paris", ["Roma", "Rome"], "Oslo", None]
    prompts = ["q"] * 4
    assert qa_em_reward(prompts, completions, answer=answer) == [1.0, 0.0, 0.0, None]
    assert qa_f1_reward(prompts, completions, answer=answer) == pytest.approx(
        [1.0, 2 / 3, 0.0, None]
    )
    assert qa_cem_reward(prompts, completions, answer=answer) == [1.0, 1.0, 0.0, None]


def test_conversational_completions():
    completions = [[{"role": "assistant", "content": "<answer>Paris</answer>"}]]
    assert qa_em_reward(["q"], completions, answer=["Paris"]) == [1.0]


def test_math_reward():
    completions = ["so \\boxed{0.5}", "<answer>3</answer>", "nothing"]
    got = math_reward(["q"] * 3, completions, answer=["\\frac{1}{2}", "4", "1"])
    assert got == [1.0, 0.0, 0.0]


def test_numeric_gold_answers_are_read_as_strings():
    """A numeric answer column (42, not "42") raised TypeError: 'int' is not iterable."""
    completions = ["<answer>42</answer>", "<answer>0.5</answer>", "<answer>7</answer>"]
    assert qa_em_reward(["q"] * 3, completions, answer=[42, 0.5, [6, 7]]) == [1.0, 1.0, 1.0]
    assert math_reward(["q"] * 3, completions, answer=[42, 0.5, 8]) == [1.0, 1.0, 0.0]


def test_pvpo_and_format_rewards():
    completions = ["<answer>it is paris</answer>", "<answer>London</answer>", "Paris"]
    assert pvpo_reward(["q"] * 3, completions, answer=["Paris"] * 3) == [0.5, 0.1, 0.0]
    assert format_reward(["q"] * 3, completions) == [1.0, 1.0, 0.0]


def test_missing_answer_column_is_a_clear_error():
    with pytest.raises(ValueError, match="'answer' column"):
        qa_em_reward(["q"], ["<answer>a</answer>"])
    with pytest.raises(ValueError, match="2 answers for 1 completions"):
        qa_em_reward(["q"], ["<answer>a</answer>"], answer=["a", "b"])


def test_registry():
    assert set(REWARD_FUNCTIONS) == {"qa_em", "qa_f1", "qa_cem", "math", "pvpo", "format"}
    assert get_reward_function("pvpo") is pvpo_reward
    with pytest.raises(ValueError, match="valid names: format, math, pvpo"):
        get_reward_function("nope")
