"""Fingerprint every preset: 3 seeded steps on a random-init tiny model, metrics and weights.

A refactoring that must not change what the trainer computes is checked by running this
before and after it and comparing the two files::

    python scripts/fingerprint_presets.py --out before.json      # on the old commit
    python scripts/fingerprint_presets.py --out after.json       # on the new one
    python scripts/fingerprint_presets.py --compare before.json after.json

Every metric except timings (``time/*``, ``*seconds*``) is recorded for every logged step,
with a SHA-256 of the final policy weights. Runs use one thread and their own anchor store
and cache, so the figures are a function of the code alone (on one machine: float
results differ across CPUs). The task is a toy a random-init model earns reward on about
half the time (reward 1 when the completion's first character has an even code point),
so every estimator sees mixed groups and non-zero gradients.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import tempfile
from pathlib import Path

COMMON = [
    "model=random:tiny",
    "task=parity",
    "steps=3",
    "rollout.prompts_per_step=2",
    "rollout.n=4",
    "rollout.max_new_tokens=8",
    "eval.every=3",
    "eval.prompts=4",
    "eval.train_prompts=4",
    "log.progress=false",
    "log.tensorboard=false",
    "checkpoint.every=0",
    "optim.lr=1e-3",
]

VARIANTS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("grpo", []),
    "grpo-minibatches": (
        "grpo",
        ["optim.epochs=2", "optim.mini_batches=2", "optim.micro_batch_size=3"],
    ),
    "drgrpo": ("drgrpo", []),
    "dapo": ("dapo", []),
    "rloo": ("rloo", []),
    "reinforce_pp": ("reinforce_pp", []),
    "reinforce_pp_baseline": ("reinforce_pp_baseline", []),
    "ppo": ("ppo", []),
    "ppo-shared": ("ppo", ["critic.mode=shared"]),
    "vapo": ("vapo", ["critic.pretrain_steps=2"]),
    # the paper's setting (the `pvpo` preset before its single-run options), under the
    # variant names the fingerprints of that preset were recorded with
    "pvpo": ("pvpo_paper", ["pvpo.m=1"]),  # acc 0 or 1 per prompt: teacher rows every step
    "pvpo-static": ("pvpo_paper", ["filter.kind=none"]),
    "pvpo-refresh-reference": ("pvpo_paper", ["pvpo.m=2", "pvpo.refresh_every=1"]),
    "pvpo-refresh-policy": ("pvpo_paper", ["pvpo.refresh_every=1", "pvpo.refresh_mode=policy"]),
    # the `pvpo` preset: lazy, reused first groups, sequential presampling, pooled anchors
    "pvpo-single-run": ("pvpo", ["rollout.n=2"]),  # the preset's N (COMMON sets 4)
    "v05": ("v05", []),
    "v05-knn": ("v05", ["v05.prior=knn+history"]),
    "v05-probe": (
        "v05",
        [
            "plugins=anchor_rl.bench.v05_probe",
            "components=v05_probe",
            "component_args.v05_probe.every=2",
            "component_args.v05_probe.prompts=2",
            "component_args.v05_probe.truth=4",
            "component_args.v05_probe.heldout=2",
            "component_args.v05_probe.heldout_truth=2",
        ],
    ),
}


def _clean(value):
    if isinstance(value, float) and math.isnan(value):
        return "nan"
    return value


def fingerprint(names: list[str]) -> dict[str, dict]:
    import torch

    torch.set_num_threads(1)
    from anchor_rl import tasks
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.logging import read_metrics
    from anchor_rl.trainer.loop import train
    from anchor_rl.trainer.run import start_run

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from helpers import ParityTask

    tasks.TASKS["parity"] = ParityTask
    out = {}
    for name in names:
        preset, extra = VARIANTS[name]
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["ANCHOR_RL_CACHE"] = str(Path(tmp) / "cache")
            knn = "knn" in " ".join(extra)
            anchors = preset.startswith("pvpo") or (preset == "v05" and not knn)
            store = [f"pvpo.store={tmp}/anchors.db"] if anchors else []
            cfg = load_config(preset, [*COMMON, *store, *extra])
            run = train(start_run(cfg, Path(tmp) / "run"))
            metrics = [
                {
                    k: _clean(v)
                    for k, v in r.items()
                    if not k.startswith("time/") and "seconds" not in k
                }
                for r in read_metrics(run.run_dir)
            ]
            digest = hashlib.sha256()
            for key, tensor in sorted(run.policy.state_dict().items()):
                digest.update(key.encode())
                digest.update(
                    tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
                )
            out[name] = {"metrics": metrics, "weights_sha256": digest.hexdigest()}
        print(
            f"{name}: {len(metrics)} records, weights {out[name]['weights_sha256'][:12]}",
            flush=True,
        )
    return out


def compare(before: dict, after: dict) -> int:
    """Print every difference; return the number of variants whose values differ.

    A metric logged on one side only is listed apart (with its values on the other side),
    so a metric that stopped being logged is told from one whose value moved.
    """
    differ = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'after' if a is None else 'before'}")
            differ += 1
            continue
        moved, dropped, added = set(), {}, {}
        for ra, rb in zip(a["metrics"], b["metrics"], strict=False):
            for key in set(ra) | set(rb):
                if key in ra and key in rb:
                    if ra[key] != rb[key]:
                        moved.add(key)
                elif key in ra:
                    dropped.setdefault(key, set()).add(ra[key])
                else:
                    added.setdefault(key, set()).add(rb[key])
        if len(a["metrics"]) != len(b["metrics"]):
            moved.add("<number of records>")
        weights = a["weights_sha256"] == b["weights_sha256"]
        notes = [f"weights {'same' if weights else 'differ'}"]
        if moved:
            notes.append(f"values moved: {', '.join(sorted(moved))}")
        if dropped:
            notes.append(
                "no longer logged: "
                + ", ".join(f"{k} (was {sorted(v)})" for k, v in sorted(dropped.items()))
            )
        if added:
            notes.append("newly logged: " + ", ".join(sorted(added)))
        if moved or not weights:
            differ += 1
        print(f"{name}: " + ("identical" if len(notes) == 1 and weights else "; ".join(notes)))
    return differ


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--only", nargs="*", default=None, help="variants to run (default all)")
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        sys.exit(1 if compare(before, after) else 0)
    result = fingerprint(args.only or list(VARIANTS))
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
