"""Seconds per step of a preset with shared-prefix scoring off and on, alternating.

    OMP_NUM_THREADS=1 python benchmarks/time_shared_prefix.py vapo sft:tiny random:small \
        --out docs/results/shared-prefix/vapo_timings.json

Each (model, setting) trains ``--steps`` steps of 8 prompts x 8 responses (<= 80 new
tokens, no value pretraining, no evaluation) in a fresh run directory under a temporary
folder, twice, alternating ``optim.shared_prefix=off`` and ``auto``; the first step of each
run is a warm-up and is left out. ``off`` also turns the critic's shared prefixes off (the
critic then scores packed). Prints one line per run and writes every run's mean
``time/generate`` and ``time/update`` as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train_step
from anchor_rl.trainer.run import start_run

SETTINGS = [
    "critic.pretrain_steps=0",
    "rollout.prompts_per_step=8",
    "rollout.n=8",
    "rollout.max_new_tokens=80",
    "eval.every=0",
    "checkpoint.every=0",
    "log.progress=false",
    "log.tensorboard=false",
]


def time_run(preset: str, model: str, mode: str, steps: int, root: Path) -> dict:
    """Mean seconds of the measured steps of one run."""
    overrides = [f"model={model}", f"optim.shared_prefix={mode}", f"steps={steps}", *SETTINGS]
    run = start_run(load_config(preset, overrides), root / f"{model.replace(':', '-')}-{mode}")
    records = []
    for _ in range(steps):
        records.append(train_step(run))
        run.state.step += 1
    measured = records[1:]
    mean = {k: statistics.mean(r[f"time/{k}"] for r in measured) for k in ("generate", "update")}
    return {"preset": preset, "model": model, "shared_prefix": mode, "steps": len(measured),
            "tokens_per_step": statistics.mean(r["tokens/step"] for r in measured),
            "generate_s": mean["generate"], "update_s": mean["update"]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("preset")
    parser.add_argument("models", nargs="+")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for mode in ("off", "auto", "off", "auto"):
                rows.append(
                    time_run(args.preset, model, mode, args.steps, Path(tmp) / str(len(rows)))
                )
                print(json.dumps(rows[-1]), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        host = {"threads": torch.get_num_threads(), "torch": torch.__version__}
        args.out.write_text(json.dumps({"host": host, "runs": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
