"""Verifier guard: an exception or a timeout becomes a counted, logged failure, not a crash."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

_log = logging.getLogger(__name__)


class SafeVerifier:
    """Wraps a verifier so that a raising or slow call yields ``on_error`` and is counted.

    ``__call__`` guards one call of ``fn`` (a per-sample scorer such as ``task.reward``).
    :meth:`map` guards a TRL-convention batch function sample by sample, so one bad
    completion costs one reward, not the batch.

    Args:
        fn: the verifier.
        on_error: the value returned for a failed or timed-out call (0.0, or None to
            mark the reward missing).
        timeout: seconds after which a call counts as timed out. The call then runs on
            in a daemon thread (Python cannot stop a thread) and its result is dropped;
            use it for verifiers that may be slow, not for ones that never return. While
            such a call holds the GIL (regex backtracking, a huge integer conversion) the
            whole process waits, time limit or not: bound that work in the verifier.
            Verifiers that bound themselves (``math_equal``) need none: a ``TimeoutError``
            they raise is counted as a timeout either way.
        name: label for log lines (defaults to ``fn``'s name).
        log_first: how many failures and how many timeouts are logged (each is counted).

    Counters (read them to log): ``calls``, ``failures`` (exceptions), ``timeouts``;
    ``last_error`` holds the latest message.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        on_error: float | None = 0.0,
        timeout: float | None = None,
        name: str | None = None,
        log_first: int = 5,
    ) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
        self.fn = fn
        self.on_error = on_error
        self.timeout = timeout
        self.name = name or getattr(fn, "__name__", type(fn).__name__)
        self.log_first = log_first
        self.calls = 0
        self.failures = 0
        self.timeouts = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, or ``on_error`` if it raises or times out."""
        return self._guarded(lambda: self.fn(*args, **kwargs))

    def map(
        self, prompts: Sequence[Any], completions: Sequence[Any], **columns: Any
    ) -> list[float | None]:
        """Apply a TRL-convention reward function one sample at a time.

        Column values that are sequences as long as ``completions`` are sliced per
        sample; other keyword arguments are passed through unchanged.
        """
        n = len(completions)
        if len(prompts) != n:
            raise ValueError(f"{len(prompts)} prompts for {n} completions")

        def one(i: int) -> float | None:
            sliced = {
                k: v[i : i + 1] if isinstance(v, list | tuple) and len(v) == n else v
                for k, v in columns.items()
            }
            values = self.fn(prompts[i : i + 1], completions[i : i + 1], **sliced)
            if len(values) != 1:
                raise ValueError(f"{self.name} returned {len(values)} rewards for 1 completion")
            return values[0]

        return [self._guarded(lambda i=i: one(i)) for i in range(n)]

    def stats(self) -> dict[str, int]:
        """The counters as a dict, for a metrics logger."""
        with self._lock:
            return {"calls": self.calls, "failures": self.failures, "timeouts": self.timeouts}

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the lock is left out and made anew), so a task holding guards is too."""
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def _guarded(self, call: Callable[[], Any]) -> Any:
        with self._lock:
            self.calls += 1
        try:
            return self._run(call)
        except TimeoutError as exc:
            self._record("timeout", exc)
        except Exception as exc:
            self._record("failure", exc)
        return self.on_error

    def _run(self, call: Callable[[], Any]) -> Any:
        if self.timeout is None:
            return call()
        box: dict[str, Any] = {}

        def target() -> None:
            try:
                box["value"] = call()
            except BaseException as exc:  # handed to the caller's thread below
                box["error"] = exc

        worker = threading.Thread(target=target, name=f"verifier-{self.name}", daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            raise TimeoutError(
                f"no result after {self.timeout:g}s (left running in the background)"
            )
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _record(self, kind: str, exc: BaseException) -> None:
        message = f"{type(exc).__name__}: {exc}"
        with self._lock:
            if kind == "timeout":
                self.timeouts += 1
                count = self.timeouts
            else:
                self.failures += 1
                count = self.failures
            self.last_error = message
        if count <= self.log_first:
            more = " (further ones are counted, not logged)" if count == self.log_first else ""
            _log.warning(
                "verifier %s %s #%d, reward set to %r: %s%s",
                self.name,
                kind,
                count,
                self.on_error,
                message,
                more,
            )
