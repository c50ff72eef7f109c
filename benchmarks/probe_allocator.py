"""GRPO training steps with glibc's default allocator settings and with anchor-rl's
(``anchor_rl.allocator``), on the CPU, one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/probe_allocator.py sft:tiny random:small \
        --rounds 3 --steps 12 --out FILE

For each model spec and round, two fresh processes, alternating (``ANCHOR_RL_MALLOC=default``
in one, the run's own setting in the other), each training the ``grpo`` preset on the
arithmetic task (8 prompts x 8 responses, <= 80 new tokens) for 2 warm-up steps and then
``--steps`` timed ones: seconds, minor page faults and system CPU seconds per timed step
(``getrusage``). Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit

WARMUP = 2


def child(spec: str, steps: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Train ``spec`` in this process; per-step figures of the timed steps."""
    import torch

    from anchor_rl import allocator
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.loop import train_step
    from anchor_rl.trainer.run import start_run

    torch.set_num_threads(1)
    overrides = [
        f"model={spec}", "task=arithmetic", f"steps={WARMUP + steps}",
        "rollout.prompts_per_step=8", "rollout.n=8", f"rollout.max_new_tokens={max_new_tokens}",
        "eval.every=0", "checkpoint.every=0", "log.tensorboard=false", "log.progress=false",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        run = start_run(load_config("grpo", overrides), Path(tmp) / "run")
        for _ in range(WARMUP):
            train_step(run)
            run.state.step += 1
        before, started = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        for _ in range(steps):
            train_step(run)
            run.state.step += 1
        seconds, after = time.perf_counter() - started, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "kept": bool(allocator._applied),
        "s_per_step": round(seconds / steps, 4),
        "faults_per_step": (after.ru_minflt - before.ru_minflt) // steps,
        "sys_s_per_step": round((after.ru_stime - before.ru_stime) / steps, 4),
    }


def measure(spec: str, rounds: int, steps: int, max_new_tokens: int = 80) -> dict[str, Any]:
    """Both settings, ``rounds`` times each in fresh processes, alternating."""
    runs: dict[str, list[dict[str, Any]]] = {"default": [], "kept": []}
    for i in range(rounds):
        for way in runs if i % 2 == 0 else reversed(runs):
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            env.pop("ANCHOR_RL_MALLOC", None)
            if way == "default":
                env["ANCHOR_RL_MALLOC"] = "default"
            out = subprocess.run(
                [sys.executable, __file__, "--child", spec, "--steps", str(steps),
                 "--max-new-tokens", str(max_new_tokens)],
                env=env, capture_output=True, text=True, check=True,
            )  # fmt: skip
            runs[way].append(json.loads(out.stdout.strip().splitlines()[-1]))
    medians = {
        way: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "kept"}
        for way, rs in runs.items()
    }
    return {
        "spec": spec,
        "runs": runs,
        "medians": medians,
        "kept / default s": round(
            medians["kept"]["s_per_step"] / medians["default"]["s_per_step"], 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("specs", nargs="*", default=["sft:tiny", "random:small"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.specs[0], args.steps, args.max_new_tokens)))
        return
    import torch

    result = {"threads": 1, "torch": torch.__version__, "steps": args.steps}
    result["specs"] = [measure(s, args.rounds, args.steps, args.max_new_tokens) for s in args.specs]
    emit(result, args.out)


if __name__ == "__main__":
    main()
