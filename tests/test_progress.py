"""Progress: plain lines in a log file, a bar that fits 80 columns on a terminal."""

from __future__ import annotations

import io
import re
import subprocess
import sys

import pytest
from rich.console import Console

from anchor_rl.errors import ConfigError
from anchor_rl.progress import EVERY_ENV, Progress


def test_a_log_file_gets_a_line_at_the_start_every_interval_and_at_the_end() -> None:
    out = io.StringIO()  # not a terminal
    with Progress("train", 4, enabled=True, stream=out, every=0) as bar:
        for step in range(1, 5):
            bar.update(step, info=f"reward {step / 10}")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("train 0/4 (0%) elapsed 0:00:00")
    assert lines[-1].startswith("train 4/4 (100%)") and lines[-1].endswith("| reward 0.4")
    assert len(lines) == 5 and "left" in lines[2]  # step 2 of 4: time left from the rate


def test_lines_are_rate_limited_and_the_last_one_always_printed() -> None:
    out = io.StringIO()
    with Progress("presample", 1000, stream=out, every=3600) as bar:
        for _ in range(999):
            bar.update(advance=1)
    lines = out.getvalue().splitlines()
    assert [line.split()[1] for line in lines] == ["0/1000", "999/1000"]  # start, then the end


def test_disabled_prints_nothing() -> None:
    out = io.StringIO()
    with Progress("eval", 3, enabled=False, stream=out, every=0) as bar:
        bar.update(3)
    assert out.getvalue() == ""


def test_the_terminal_bar_fits_80_columns_and_keeps_the_count(monkeypatch) -> None:
    buffer = io.StringIO()
    monkeypatch.setattr(
        "anchor_rl.progress.Console",
        lambda file: Console(file=buffer, width=80, force_terminal=True, color_system=None),
    )
    with Progress("train", 100, every=0) as bar:
        bar.update(37, info="reward 0.52 acc 0.5 eval 0.33 len 24.5 kl 0.0012 s/step 5.43")
        bar._bar.refresh()
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", buffer.getvalue())  # cursor controls
    rows = [r for r in text.replace("\r", "\n").splitlines() if "37/100" in r]
    assert rows and all(len(r.rstrip()) <= 80 for r in rows)
    assert "train" in rows[-1] and "reward 0.52" in rows[-1] and "━" in rows[-1]


def test_training_into_a_log_file_shows_progress_before_the_end(tmp_path) -> None:
    log = tmp_path / "train.log"
    args = [
        sys.executable, "-m", "anchor_rl.cli", "train", "model=random:tiny", "train_prompts=4",
        "steps=3", "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8",
        "eval.every=0", "log.tensorboard=false", "--out", str(tmp_path / "run"),
    ]  # fmt: skip
    with log.open("w") as f:
        done = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, timeout=300,
                              env={**_env(), "ANCHOR_RL_PROGRESS_EVERY": "0"})  # fmt: skip
    assert done.returncode == 0, log.read_text()[-2000:]
    lines = log.read_text().splitlines()
    steps = [line.split()[1] for line in lines if line.startswith("train ")]
    assert steps[:4] == ["0/3", "1/3", "2/3", "3/3"]
    assert any("reward" in line for line in lines if line.startswith("train 1/3"))


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "ANCHOR_RL_PROGRESS_EVERY"}


@pytest.mark.parametrize("value", ["5s", "-1", "nan"])
def test_a_progress_interval_that_is_no_number_of_seconds_names_the_variable(
    monkeypatch, value
) -> None:
    monkeypatch.setenv(EVERY_ENV, value)
    with pytest.raises(ConfigError, match=rf"{EVERY_ENV}='{value}' is not a number of seconds"):
        Progress("eval", 3, stream=io.StringIO())
    monkeypatch.setenv(EVERY_ENV, "2.5")
    assert Progress("eval", 3, stream=io.StringIO()).every == 2.5
