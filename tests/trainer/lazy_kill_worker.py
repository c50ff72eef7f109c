"""A lazy-presampling PVPO run on the parity task that SIGKILLs itself mid-run.

Usage: ``python lazy_kill_worker.py RUN_DIR OVERRIDES_JSON``. The run starts with the
``pvpo`` preset and the overrides; once step 1's checkpoint is on disk, the next lazy
presampling call (step 2's prompts) stores its rows, writes ``RUN_DIR/walk.json`` (prompts
walked, newest checkpoint) and kills the process with SIGKILL before step 2 ends.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from helpers import ParityTask

from anchor_rl.methods.pvpo import LazyWalk
from anchor_rl.trainer import run as run_module
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train


def main() -> None:
    run_dir, overrides = Path(sys.argv[1]), json.loads(sys.argv[2])
    task = ParityTask()
    run_module.get_task = lambda name, **kwargs: task
    real_take = LazyWalk._take

    def take_then_die(self, chunk):
        real_take(self, chunk)
        checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
        if checkpoints:
            state = {"walked": self.walked, "checkpoint": int(checkpoints[-1].name[5:])}
            (run_dir / "walk.json").write_text(json.dumps(state))
            os.kill(os.getpid(), signal.SIGKILL)

    LazyWalk._take = take_then_die
    train(run_module.start_run(load_config("pvpo_paper", overrides), run_dir))


if __name__ == "__main__":
    main()
