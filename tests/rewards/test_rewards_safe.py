import logging
import threading

import pytest

from anchor_rl.rewards.safe import SafeVerifier


def test_exceptions_become_counted_failures(caplog):
    safe = SafeVerifier(lambda x: 1 / x, on_error=0.0, name="inverse")
    with caplog.at_level(logging.WARNING, logger="anchor_rl.rewards.safe"):
        assert safe(4) == 0.25
        assert safe(0) == 0.0
    assert safe.stats() == {"calls": 2, "failures": 1, "timeouts": 0}
    assert "ZeroDivisionError" in safe.last_error
    assert "verifier inverse failure #1" in caplog.text


def test_on_error_none_marks_missing():
    safe = SafeVerifier(lambda: [][0], on_error=None)
    assert safe() is None
    assert safe.failures == 1


def test_timeout_error_raised_by_the_verifier_counts_as_timeout():
    def slow():
        raise TimeoutError("took too long")

    safe = SafeVerifier(slow)
    assert safe() == 0.0
    assert safe.stats() == {"calls": 1, "failures": 0, "timeouts": 1}


def test_timeout_knob_abandons_a_stuck_call():
    release = threading.Event()
    safe = SafeVerifier(lambda: release.wait(30) and 1.0, on_error=-1.0, timeout=0.1)
    try:
        assert safe() == -1.0
        assert safe.timeouts == 1
        assert "no result after 0.1s" in safe.last_error
    finally:
        release.set()


def test_timeout_knob_passes_results_and_errors_through():
    assert SafeVerifier(lambda: 0.5, timeout=5)() == 0.5
    safe = SafeVerifier(lambda: 1 / 0, timeout=5)
    assert safe() == 0.0
    assert safe.failures == 1


def test_map_isolates_samples_of_a_trl_function():
    def reward_fn(prompts, completions, answer, **kwargs):
        assert kwargs["trainer_state"] == "state"  # non-column kwargs pass through
        if completions[0] == "bad":
            raise RuntimeError("cannot parse")
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    safe = SafeVerifier(reward_fn)
    got = safe.map(
        ["p1", "p2", "p3"], ["a", "bad", "x"], answer=["a", "b", "c"], trainer_state="state"
    )
    assert got == [1.0, 0.0, 0.0]
    assert safe.stats() == {"calls": 3, "failures": 1, "timeouts": 0}


def test_map_counts_a_wrong_number_of_rewards():
    safe = SafeVerifier(lambda prompts, completions: [1.0, 1.0])
    assert safe.map(["p"], ["c"]) == [0.0]
    assert "returned 2 rewards" in safe.last_error


def test_map_checks_lengths():
    with pytest.raises(ValueError, match="2 prompts for 1 completions"):
        SafeVerifier(lambda p, c: [0.0]).map(["a", "b"], ["c"])
