"""Stopping a long job on SIGTERM or SIGINT (Ctrl-C) without losing its work.

One handler serves every job that can keep its work (the training loop, SFT). Inside
:func:`stop_signals` the first SIGTERM or SIGINT only *requests* a stop: the job sees
``request.requested`` at its next safe point (the end of a training step, of an SFT
optimiser step), writes its state and raises :class:`Interrupted` with a message that
says what it kept and how to continue. A second signal raises :class:`Interrupted` at
once, wherever the job is, except inside :func:`shielded` (the rename that publishes a
checkpoint), which it leaves first.

:class:`Interrupted` is a ``KeyboardInterrupt``, so code that stops on Ctrl-C stops on it
too, and its ``exit_code`` is the shells' ``128 + signal``: 130 for SIGINT, 143 for SIGTERM.
Outside :func:`stop_signals` the process's own handlers apply. The handler is installed
only from the main thread (Python delivers signals there); elsewhere the request is inert.

A block with nothing to keep (a run being set up, before its first step) passes
``at_once``: the first signal raises :class:`Interrupted` with that message at once. A
library that installs its own handler inside a block (``ray.init`` sets a SIGTERM handler
that calls ``sys.exit``) is followed by :func:`reclaim_signals`, which puts this module's
handler back and restores the library's when the outermost block ends.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """A job stopped by ``signum``; ``str()`` is the message for the user (what was kept, how
    to continue) and ``exit_code`` the process's exit status (128 + ``signum``)."""

    def __init__(self, signum: int, message: str = "") -> None:
        super().__init__(message)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def signal_name(self) -> str:
        return signal_name(self.signum)


def signal_name(signum: int) -> str:
    """``SIGINT``, ``SIGTERM``..."""
    return signal.Signals(signum).name


class StopRequest:
    """What the signals asked of one job: ``signum`` of the first one (None: none came)."""

    def __init__(self, notice: str = "", at_once: str | None = None) -> None:
        self.signum: int | None = None
        self.notice = notice
        self.at_once = at_once
        self._shield = 0
        self._pending = False

    @property
    def requested(self) -> bool:
        """Whether a stop was requested: the job should save its state and stop."""
        return self.signum is not None

    def stop(self, message: str) -> Interrupted:
        """The exception to raise for the requested stop, with ``message``."""
        return Interrupted(self.signum or signal.SIGINT, message)

    def _signal(self, signum: int) -> None:
        if self.at_once is not None:  # nothing to keep: stop now (after a shielded block)
            self.signum = self.signum or signum
            if self._shield:
                self._pending = True
                return
            raise self._abort()
        if self.signum is None:  # the first: the job stops at its next safe point
            self.signum = signum
            # os.write: a signal handler must not write to a buffered stream being written
            name = signal_name(signum)
            os.write(2, f"\n{name} received: {self.notice or 'stopping'}\n".encode())
            return
        if self._shield:
            self._pending = True
            return
        raise self._abort()

    def _abort(self) -> Interrupted:
        """The stop a signal raises at once: ``at_once``'s message, else none (the job
        says what it kept)."""
        signum = self.signum or signal.SIGINT
        message = "" if self.at_once is None else self.at_once.format(signal=signal_name(signum))
        return Interrupted(signum, message)


_requests: list[StopRequest] = []
_previous: dict[int, object] = {}


def _handle(signum: int, frame: FrameType | None) -> None:
    if _requests:
        _requests[-1]._signal(signum)
        return
    previous = _previous.get(signum)  # the last block is ending: what was there before
    if callable(previous):
        previous(signum, frame)
    elif signum == signal.SIGINT and previous != signal.SIG_IGN:
        raise KeyboardInterrupt


@contextmanager
def stop_signals(notice: str = "", at_once: str | None = None) -> Iterator[StopRequest]:
    """Turn SIGTERM and SIGINT into stop requests for the block (see the module docstring).

    ``notice`` is printed on stderr when the first signal comes (what the job will do, e.g.
    ``finishing step 12, then checkpointing; Ctrl-C again stops at once``). ``at_once``: a
    block with nothing to keep; the first signal raises :class:`Interrupted` with this
    message (``{signal}`` replaced by the signal's name). Blocks nest: the innermost
    receives the signals. The previous handlers are restored when the outermost block ends.
    """
    request = StopRequest(notice, at_once)
    if threading.current_thread() is not threading.main_thread():
        yield request  # signals reach the main thread only: nothing to install
        return
    if not _requests:
        _previous.update({s: signal.signal(s, _handle) for s in SIGNALS})
    _requests.append(request)
    try:
        yield request
    finally:
        _requests.remove(request)
        if not _requests:
            for s, handler in _previous.items():
                signal.signal(s, handler)  # type: ignore[arg-type]
            _previous.clear()


def reclaim_signals() -> None:
    """Inside a :func:`stop_signals` block, put its handler back for any of SIGTERM and SIGINT
    that code in the block replaced (``ray.init`` installs its own SIGTERM handler); the
    replacement is what the outermost block restores when it ends. A no-op outside a block
    or off the main thread."""
    if not _requests or threading.current_thread() is not threading.main_thread():
        return
    for s in SIGNALS:
        current = signal.getsignal(s)
        if current is not _handle:
            _previous[s] = current
            signal.signal(s, _handle)


@contextmanager
def shielded() -> Iterator[None]:
    """A block a second signal does not cut (a rename that publishes a finished file): the
    stop it asks for is raised when the block ends. A no-op outside :func:`stop_signals`."""
    if not _requests or threading.current_thread() is not threading.main_thread():
        yield
        return
    request = _requests[-1]
    request._shield += 1
    try:
        yield
    finally:
        request._shield -= 1
        if not request._shield and request._pending:
            request._pending = False
            raise request._abort()
