"""``anchor-rl train`` with one Ray rollout worker, held in its set-up once the worker has
started, for the SIGTERM-during-set-up test.

Usage: ``python setup_sigterm_driver.py RUN_DIR``. Prints ``workers started PID`` when the
Ray worker is up (Ray's own SIGTERM handler installed by then), then waits in the set-up;
when the command exits, prints ``ray initialized: BOOL`` and exits with its code.
"""

from __future__ import annotations

import sys
import time

from helpers import TINY

from anchor_rl.cli import app
from anchor_rl.cluster.engine import RayEngine

original = RayEngine._wait_started


def started_then_wait(self, actors):
    pids = original(self, actors)
    print("workers started", *pids, flush=True)
    time.sleep(120)  # the set-up, held: the test sends SIGTERM now
    return pids


def main(run_dir: str) -> None:
    RayEngine._wait_started = started_then_wait
    args = ["train", "--preset", "grpo", *TINY, "steps=1", "cluster.rollout_workers=1",
            "rollout.engine_args.threads_per_worker=1", "--out", run_dir]  # fmt: skip
    try:
        app(args, prog_name="anchor-rl")
    except SystemExit:
        import ray

        print(f"ray initialized: {ray.is_initialized()}", flush=True)
        raise


if __name__ == "__main__":
    main(sys.argv[1])
