"""A presample job with a fast fake sampler, run as a subprocess by the kill -9 resume test.

Usage: ``python presample_worker.py DB LOG PROMPTS M BATCH SLEEP [GATE]``. Prompt ``q{i}``'s
rollout ``j`` gets reward 1 (correct) iff ``j < i % (M + 1)``, so its stored mean must be
``min(i % (M + 1), M) / M``. Every sampler call appends its prompt ids to LOG (one line
per call, flushed) before sleeping SLEEP seconds, so the test sees what each run sampled.
With GATE (a path), each call then waits until that file exists (at most 60 s): the test
decides when the job may go on.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.presample import presample
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.tasks.base import Record

KEY = AnchorKey(
    model="fake-reference", tokenizer="fake", sampling={"temperature": 1.0}, task="kill-test"
)


def main() -> None:
    db, log, prompts, m, batch, pause = sys.argv[1:7]
    gate = Path(sys.argv[7]) if len(sys.argv) > 7 else None
    m = int(m)
    records = [Record(id=f"q{i}", prompt=f"question {i}", answer="") for i in range(int(prompts))]

    def sampler(batch_records, n, first, seed):
        with open(log, "a") as f:
            f.write(" ".join(r.id for r in batch_records) + "\n")
        time.sleep(float(pause))
        deadline = time.monotonic() + 60  # a test that never opens the gate fails, not hangs
        while gate is not None and not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        solved = torch.tensor([int(r.id[1:]) % (m + 1) for r in batch_records])
        correct = torch.arange(n)[None, :] < solved[:, None]
        return correct.double(), correct

    with AnchorStore(db) as store:
        result = presample(records, sampler, store, KEY, m, batch_size=int(batch), progress=False)
    print(f"rollouts={result.rollouts} reused={result.prompts_reused}")


if __name__ == "__main__":
    main()
