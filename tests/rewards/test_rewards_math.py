import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from anchor_rl.rewards.math import MathVerifier, math_equal

CASES = [
    ("0.5", "1/2", True),
    ("\\frac{1}{2}", "0.5", True),
    ("\\frac12", "1/2", True),
    ("$2$", "2", True),
    ("1,000", "1000", True),
    ("x+1", "1+x", True),
    ("\\sqrt{4}", "2", True),
    ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2", True),
    ("3", "4", False),
    ("0.333", "1/3", False),
    ("", "3", False),
    ("garbage{{", "3", False),
]
# an exponent tower math-verify cannot finish evaluating in a second
HANGS = "10^{10^{10}}"


@pytest.fixture(scope="module")
def verifier():
    v = MathVerifier(timeout=1.0, processes=2)
    yield v
    v.close()


@pytest.mark.parametrize(("pred", "gold", "equal"), CASES)
def test_math_equal_main_thread(pred, gold, equal):
    assert threading.current_thread() is threading.main_thread()
    assert math_equal(pred, gold) is equal


def test_missing_prediction_is_false_and_empty_gold_an_error():
    assert math_equal(None, "3") is False
    with pytest.raises(ValueError, match="empty gold"):
        math_equal("3", " $ ")


def test_math_equal_inside_a_thread_pool(verifier):
    with ThreadPoolExecutor(max_workers=4) as pool:
        got = list(pool.map(lambda c: verifier.equal(c[0], c[1]), CASES))
    assert got == [equal for _, _, equal in CASES]


def test_timeout_on_main_thread_raises():
    with pytest.raises(TimeoutError, match="more than 0.5s"):
        MathVerifier(timeout=0.5).equal(HANGS, "3")


def test_timeout_in_a_worker_thread_raises_and_the_pool_keeps_working(verifier):
    with ThreadPoolExecutor(max_workers=2) as pool:
        slow = pool.submit(verifier.equal, HANGS, "3")
        with pytest.raises(TimeoutError):
            slow.result()
        assert pool.submit(verifier.equal, "1/2", "0.5").result() is True


def test_rejects_bad_settings():
    with pytest.raises(ValueError, match="timeout"):
        MathVerifier(timeout=0)
    with pytest.raises(ValueError, match="processes"):
        MathVerifier(processes=0)
