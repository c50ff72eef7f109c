"""Math answer equivalence with math-verify, thread-safe and bounded in time.

math-verify bounds its ``parse``/``verify`` calls with ``signal.alarm``, which only works
on the main thread of the main interpreter (from any other thread it raises
``ValueError``). So :class:`MathVerifier` turns math-verify's own timeouts off and bounds
the whole comparison (parse gold, parse prediction, verify) with one deadline of its own:

- on the main thread: a ``SIGALRM`` interval timer (``signal.setitimer``, sub-second),
  set and cleared around the call (any timer the application had set is cancelled);
- on any other thread (a ``ThreadPoolExecutor``, a rollout worker): the call runs in a
  small pool of ``spawn`` worker processes, where it again runs on a main thread under
  the same timer; the caller additionally stops waiting after ``timeout + grace``
  seconds and restarts the pool if a worker is stuck beyond its own timer. Restarting
  also abandons the other calls then in flight in that pool; they time out too.

The deadline bounds math-verify's work; before it, a length cap bounds the input:
a prediction longer than ``max_chars`` characters (1,000 by default), or than twice the
gold answer when that is longer, is False without being parsed. Competition answers
are a few dozen characters, so such a prediction cannot be right, and parsing a
megabyte of LaTeX would only burn the whole deadline.

A timed-out comparison raises :class:`TimeoutError` rather than returning False, so the
caller (usually :class:`anchor_rl.rewards.safe.SafeVerifier`) can count it. POSIX only
(``SIGALRM``). Like any ``spawn`` pool, the worker processes import the caller's
``__main__`` module, so scripts that compare from threads need the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.pool import Pool

from math_verify import parse, verify

MAX_ANSWER_CHARS = 1_000
"""The longest prediction :class:`MathVerifier` parses by default (see the module docstring)."""

_log = logging.getLogger(__name__)


class _Deadline(BaseException):
    """Raised by the alarm; a BaseException so math-verify's ``except Exception`` lets it through."""


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns that its timeouts are off; here the deadline below replaces them."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropDisabledTimeoutWarning())


@contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    """Raise :class:`_Deadline` in the main thread once ``seconds`` have passed."""
    if not hasattr(signal, "setitimer"):
        raise NotImplementedError("anchor_rl.rewards.math needs POSIX signals (SIGALRM)")

    def on_alarm(signum: int, frame: object) -> None:
        raise _Deadline

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _clean(s: str) -> str:
    return s.strip().strip("$").strip()


def _compare_on_main_thread(pred: str, gold: str, timeout: float) -> bool:
    """math-verify on ``\\boxed{gold}`` and ``\\boxed{pred}`` under one deadline (main thread only)."""
    try:
        with _deadline(timeout):
            gold_parsed = parse(f"\\boxed{{{gold}}}", parsing_timeout=None, raise_on_error=True)
            pred_parsed = parse(f"\\boxed{{{pred}}}", parsing_timeout=None, raise_on_error=True)
            return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None, raise_on_error=True))
    except _Deadline:
        raise TimeoutError(
            f"math-verify took more than {timeout:g}s on pred={pred[:80]!r}, gold={gold[:80]!r}"
        ) from None


def _warm_up() -> None:
    """Worker initializer: one comparison, so a worker takes tasks only once math-verify is loaded."""
    _compare_on_main_thread("1", "1/1", 60.0)


def _ready() -> bool:
    return True


class MathVerifier:
    """Compares math answers with math-verify; safe to call from any thread.

    Args:
        timeout: seconds allowed for one comparison (parse both sides and verify).
        processes: worker processes used for calls made off the main thread.
        grace: extra seconds the caller waits for a worker beyond ``timeout`` before it
            declares the worker stuck and restarts the pool.
        max_chars: the longest prediction compared (or twice the gold's length if that
            is more); a longer one is not equal, without being parsed.
    """

    def __init__(
        self,
        timeout: float = 5.0,
        processes: int = 2,
        grace: float = 10.0,
        max_chars: int = MAX_ANSWER_CHARS,
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout}")
        if processes < 1:
            raise ValueError(f"processes must be >= 1, got {processes}")
        if max_chars < 1:
            raise ValueError(f"max_chars must be >= 1, got {max_chars}")
        self.max_chars = max_chars
        self.timeout = timeout
        self.processes = processes
        self.grace = grace
        self._pool: Pool | None = None
        self._lock = threading.Lock()

    def equal(self, pred: str | None, gold: str) -> bool:
        """Whether the predicted answer equals the gold answer mathematically.

        Both are answer strings (not whole completions; see ``extract_answer``), LaTeX or
        plain (``0.5``, ``1/2``, ``\\frac{1}{2}`` all match). Surrounding ``$`` are
        dropped. An empty or missing prediction is False, and so is one longer than
        ``max_chars`` characters (or twice the gold's length, if more): it is not parsed.
        Raises TimeoutError when the comparison takes longer than ``timeout`` seconds.
        """
        if pred is None:
            return False
        pred, gold = _clean(pred), _clean(gold)
        if not gold:
            raise ValueError("empty gold answer")
        if not pred or len(pred) > max(self.max_chars, 2 * len(gold)):
            return False
        if pred == gold:
            return True
        if threading.current_thread() is threading.main_thread():
            return _compare_on_main_thread(pred, gold, self.timeout)
        return self._compare_in_worker(pred, gold)

    def _compare_in_worker(self, pred: str, gold: str) -> bool:
        pool = self._get_pool()
        pending = pool.apply_async(_compare_on_main_thread, (pred, gold, self.timeout))
        try:
            return pending.get(self.timeout + self.grace)
        except multiprocessing.TimeoutError:
            self._restart(pool)
            raise TimeoutError(
                f"math-verify worker did not answer within {self.timeout + self.grace:g}s; "
                "pool restarted"
            ) from None

    def _get_pool(self) -> Pool:
        with self._lock:
            if self._pool is None:
                pool = multiprocessing.get_context("spawn").Pool(
                    self.processes, initializer=_warm_up
                )
                # Once one worker is up, tasks never wait on a worker's start-up.
                pool.apply_async(_ready).get(120.0)
                self._pool = pool
            return self._pool

    def _restart(self, pool: Pool) -> None:
        with self._lock:
            if self._pool is pool:
                _log.warning("math-verify worker stuck past its deadline; restarting the pool")
                pool.terminate()
                self._pool = None

    def close(self) -> None:
        """Stop the worker processes (a later off-main-thread call starts new ones)."""
        with self._lock:
            if self._pool is not None:
                self._pool.terminate()
                self._pool.join()
                self._pool = None


_DEFAULT = MathVerifier()


def math_equal(pred: str | None, gold: str) -> bool:
    """Whether ``pred`` and ``gold`` are the same math answer (math-verify, 5 s deadline).

    A prediction over :data:`MAX_ANSWER_CHARS` characters (or twice the gold's length)
    is False without being parsed.

    Thread-safe; raises TimeoutError past the deadline. Uses a shared
    :class:`MathVerifier`; build your own for another timeout or pool size.
    """
    return _DEFAULT.equal(pred, gold)
