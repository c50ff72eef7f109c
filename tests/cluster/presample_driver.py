"""A driver that presamples PVPO anchors through rollout workers, for the kill -9 test.

Usage: ``python presample_driver.py DB PROMPTS M ENGINE [ADDRESS]`` with ENGINE ``ray`` (2 Ray
workers of one thread: on the running Ray cluster at ADDRESS, half a CPU each, or without
ADDRESS on a Ray started here with 2 CPUs, one CPU each) or ``hf`` (this process). Presamples
the first PROMPTS arithmetic training prompts M times with a random tiny model into the store
DB.
"""

from __future__ import annotations

import os
import sys

import torch

from anchor_rl.anchors.store import AnchorStore
from anchor_rl.methods.pvpo import presample_set
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.tasks import get_task
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.pvpo import presample_params

BATCH = 4  # prompts per sampling call: the store commits after each


def main(db: str, prompts: int, m: int, engine: str, address: str = "") -> None:
    torch.set_num_threads(1)
    cfg = load_config("pvpo_paper", ["rollout.max_new_tokens=16", f"pvpo.m={m}",
                                     f"pvpo.presample_batch={BATCH}"])  # fmt: skip
    task = get_task("arithmetic")
    tokenizer = build_tokenizer()
    model = build_model("tiny", tokenizer, seed=0).eval()
    options: tuple[str, dict] = ("hf", {})
    if engine == "ray":
        import ray

        os.environ["RAY_AUTH_MODE"] = "disabled"
        if address:
            ray.init(address=address)
        else:
            ray.init(address="local", num_cpus=2, include_dashboard=False)
        cpus = 0.5 if address else 1
        options = ("ray", {"workers": 2, "threads_per_worker": 1, "num_cpus_per_worker": cpus})
    records = task.records("train")[:prompts]
    params = presample_params(cfg, task)
    presample_set(model, tokenizer, task, "arithmetic", params, records, AnchorStore(db),
                  cfg.pvpo, options, progress=False)  # fmt: skip
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:])
