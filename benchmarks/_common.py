"""What the probe scripts in this folder share: one ``grpo`` step's rollout to time, the
median of timed calls, the probes' command line and their JSON output.

The scripts import it as a sibling module (``python benchmarks/probe_NAME.py`` puts this
folder on ``sys.path``); it is not part of the installed package.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def grpo_step_call(
    spec: str, max_new_tokens: int = 80, prompts: int = 8, device: str = "cpu"
) -> tuple[Any, ...]:
    """``(model, tokenizer, call)`` for timing one ``grpo`` step's rollout on ``device``: the
    model of ``spec`` (e.g. ``sft:tiny``, ``random:small``) and the arguments of
    ``engine.rollout(*call)`` for the first ``prompts`` arithmetic training prompts, 8
    responses each, T = 1, at most ``max_new_tokens`` new tokens (the TRL comparison's
    step). What the probes time."""
    from anchor_rl.rollout.spec import load_spec
    from anchor_rl.tasks import get_task
    from anchor_rl.trainer.collect import rollout_call
    from anchor_rl.trainer.config import build_config

    cfg = build_config(
        {"preset": "grpo", "task": "arithmetic", "model": spec,
         "rollout": {"max_new_tokens": max_new_tokens}}
    )  # fmt: skip
    model, tokenizer = load_spec(spec, "arithmetic", {}, 0, device, progress=False)
    task = get_task("arithmetic")
    call = rollout_call(task, task.records("train")[:prompts], range(prompts), cfg)
    return model, tokenizer, call


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    """Median wall seconds of ``repeats`` calls of ``fn`` after one warm-up call."""
    import statistics
    import time

    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def probe_cli(doc: str, measure: Callable[[argparse.Namespace], dict[str, Any]]) -> None:
    """The command line of a probe script: ``[SPEC ...] [--repeats N] [--out FILE]`` (specs
    default to ``sft:tiny random:small``), one torch thread; prints ``measure(args)`` with
    the thread count and torch version as JSON and writes it to ``--out``."""
    import torch

    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("specs", nargs="*", default=["sft:tiny", "random:small"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    emit({"threads": 1, "torch": torch.__version__, **measure(args)}, args.out)


def emit(result: dict[str, Any], out: Path | None) -> None:
    """Print a probe's ``result`` as JSON and, given ``out``, write it there too."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
