"""Progress of long jobs (training, SFT, presampling, evaluation, value pretraining).

On a terminal it is a one-line rich bar sized to fit 80 columns (label, bar, count,
elapsed, time left, the latest figures, cut with an ellipsis when the window is narrow).
When the output goes to a file or a pipe -- a log, a CI job, ``nohup`` -- a bar would
print nothing useful until the end, so it prints one plain line at the start, then at
most one every ``ANCHOR_RL_PROGRESS_EVERY`` seconds (default 30), and one at the end::

    train 12/100 (12%) elapsed 0:01:05 left 0:07:58 | reward 0.52 acc 0.5 s/step 5.4
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import IO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.progress import Progress as RichProgress
from rich.table import Column

from anchor_rl.errors import ConfigError

EVERY_ENV = "ANCHOR_RL_PROGRESS_EVERY"
DEFAULT_EVERY = 30.0


def every_from_env() -> float:
    """Seconds between plain lines: ``$ANCHOR_RL_PROGRESS_EVERY`` (a number >= 0), or 30;
    ConfigError naming the variable when it holds anything else (``5s``)."""
    raw = os.environ.get(EVERY_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_EVERY
    try:
        every = float(raw)
    except ValueError:
        every = math.nan
    if not every >= 0:  # nan and negative numbers too
        raise ConfigError(
            f"{EVERY_ENV}={raw!r} is not a number of seconds >= 0 (e.g. {EVERY_ENV}=5); "
            "set it to one, or unset it for 30"
        )
    return every


def _clock(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def figure(x: float) -> str:
    """A number in 3 significant digits (``nan``/``inf`` as they are)."""
    return f"{x:.3g}" if math.isfinite(x) else str(x)


class Progress:
    """Progress over ``total`` units of work (see the module docstring).

    Use it as a context manager and call :meth:`update` with the units done so far (or
    ``advance=`` units more) and an ``info`` text of the latest figures.

    Args:
        label: what is running (``train``, ``sft``, ``presample``...).
        total: units of work (steps, prompts).
        done: units already done (a resumed job).
        enabled: False shows nothing.
        stream: where plain lines go (default: stdout); a terminal stream gets the bar.
        every: seconds between plain lines (default: ``$ANCHOR_RL_PROGRESS_EVERY`` or 30).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        done: int = 0,
        enabled: bool = True,
        stream: IO[str] | None = None,
        every: float | None = None,
    ) -> None:
        self.label, self.total, self.done, self.enabled = label, max(total, 0), done, enabled
        self.stream = stream or sys.stdout
        self.every = every_from_env() if every is None else every
        self.info = ""
        self._started = self._printed = 0.0
        self._start_done, self._printed_done = done, -1
        console = Console(file=self.stream)
        self._bar: RichProgress | None = None
        if enabled and console.is_terminal:
            self._bar = RichProgress(
                TextColumn(f"[bold]{label}"),
                BarColumn(bar_width=20),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True)),
                console=console,
            )
            self._task = self._bar.add_task(label, total=self.total, completed=done, info="")
            # what the other columns leave of the line: label, bar, count, two clocks, gaps
            fixed = len(label) + 20 + 2 * len(str(self.total)) + 1 + 2 * 7 + 6
            self._info_width = max(0, console.width - fixed)

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if self._bar is not None:
            self._bar.start()
        elif self.enabled:
            self._line()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif self.enabled and self._printed_done != self.done:
            self._line()

    def update(self, done: int | None = None, *, advance: int = 0, info: str | None = None) -> None:
        """Set the units done (or add ``advance``) and the figures shown beside them."""
        self.done = (self.done if done is None else done) + advance
        if info is not None:
            self.info = info
        if self._bar is not None:
            info = self.info
            if len(info) > self._info_width:
                info = info[: max(0, self._info_width - 1)] + "…"
            self._bar.update(self._task, completed=self.done, info=info)
        elif self.enabled and (
            time.monotonic() - self._printed >= self.every or self.done >= self.total
        ):
            self._line()

    def _line(self) -> None:
        elapsed = time.monotonic() - self._started
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        text = f"{self.label} {self.done}/{self.total}{share} elapsed {_clock(elapsed)}"
        rate_done = self.done - self._start_done
        if rate_done > 0 and self.done < self.total:
            text += f" left {_clock(elapsed / rate_done * (self.total - self.done))}"
        if self.info:
            text += f" | {self.info}"
        print(text, file=self.stream, flush=True)
        self._printed, self._printed_done = time.monotonic(), self.done
