import pytest

from anchor_rl.rewards import overlong, pvpo


@pytest.mark.parametrize(
    ("completion", "gold", "expected"),
    [
        ("Paris", "Paris", 0.0),  # no answer block: format wrong
        ("<search>q</search><answer>Paris</answer>", "Paris", 0.0),  # call without result
        ("<answer>London</answer>", "Paris", 0.1),  # 1 < 3 tokens: CEM 0, floor 0.1
        ("<answer>Paris</answer>", "Paris", 1.0),
        ("<answer>in paris</answer>", "Paris", 1.0),  # 2 < 3 tokens: CEM 1
        ("<answer>it is paris</answer>", "Paris", 0.5),  # 3 >= 3: F1 = 2(1/3)(1)/(4/3)
        ("<answer>it is not in paris today</answer>", "Paris", 2 / 7),  # F1, P = 1/6
        ("<answer>big new york city</answer>", "New York", 1.0),  # 4 < 6: CEM
        ("<answer>i think it is new york city</answer>", "New York", 4 / 9),  # F1, P = 2/7
        ("<search>q</search><result>d</result><answer>Paris</answer>", "Paris", 1.0),
        ("<answer>M. Giraudy</answer>", ["Miquette Giraudy", "M. Giraudy"], 1.0),
    ],
)
def test_pvpo_reward(completion, gold, expected):
    assert pvpo.reward(completion, gold) == pytest.approx(expected)


def test_pvpo_n_moves_the_f1_threshold():
    # 3 tokens vs 1 gold token: F1 = 0.5 with n=3, CEM = 1 with n=4
    assert pvpo.reward("<answer>it is paris</answer>", "Paris", n=3) == 0.5
    assert pvpo.reward("<answer>it is paris</answer>", "Paris", n=4) == 1.0


@pytest.mark.parametrize(
    ("length", "expected"),
    [(0, 0.0), (15, 0.0), (16, -0.2), (18, -0.6), (20, -1.0), (21, -1.0), (100, -1.0)],
)
def test_soft_punishment(length, expected):
    # max_len 20, cache 5: free up to 15, then (15 - length) / 5
    assert overlong.soft_punishment(length, max_len=20, cache_len=5) == pytest.approx(expected)


@pytest.mark.parametrize("cache_len", [0, -1, 21])
def test_soft_punishment_rejects_bad_cache(cache_len):
    with pytest.raises(ValueError, match="cache_len"):
        overlong.soft_punishment(10, max_len=20, cache_len=cache_len)
