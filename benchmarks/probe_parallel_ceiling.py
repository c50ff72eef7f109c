"""How much faster two processes sample than one on this machine: the ceiling for two
one-thread rollout workers against one, with no Ray in between.

    python benchmarks/probe_parallel_ceiling.py tiny small --repeats 3 --out FILE

For each size a random-init model (seed 0) samples the throughput bench's step: 8 arithmetic
training prompts x 8 responses, <= 80 new tokens, T = 1, the built-in ``hf`` engine, one
torch thread per process, in three layouts:

- ``one``: one process, the 64 responses in one engine call (one worker's batch);
- ``halves``: one process, two calls of 32 one after the other (what two workers sample,
  done by one);
- ``parallel``: two processes at the same time, each one call of 32 (two workers with
  nothing but sampling to do).

Each layout samples the same requests ``--repeats`` times after a warm-up call; the figure
is response tokens per second of wall time. ``parallel / one`` is the most two one-thread
rollout workers can gain over one on this machine; ``one / halves`` is the part of it
lost to the smaller batch alone, ``parallel / halves`` what the second core adds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path
from typing import Any

PROMPTS, N, MAX_NEW_TOKENS = 8, 8, 80


def _calls(size: str, parts: int) -> tuple[Any, list[tuple]]:
    """The engine and the rollout arguments of the step split in ``parts`` equal calls."""
    import torch

    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.spec import load_spec
    from anchor_rl.trainer.collect import rollout_call
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.run import load_task

    torch.set_num_threads(1)
    overrides = [
        f"model=random:{size}",
        f"rollout.n={N}",
        f"rollout.max_new_tokens={MAX_NEW_TOKENS}",
    ]
    cfg = load_config("grpo", overrides)
    task = load_task(cfg)
    model, tokenizer = load_spec(cfg.model, cfg.task, cfg.task_args, 0, "cpu", progress=False)
    engine = make_engine("hf", model.eval(), tokenizer)
    records = task.records("train")[:PROMPTS]
    share = PROMPTS // parts
    calls = [
        rollout_call(task, records[i : i + share], range(i, i + share), cfg)
        for i in range(0, PROMPTS, share)
    ]
    return engine, calls


def _sample(engine: Any, calls: list[tuple], repeats: int) -> tuple[int, float]:
    """(response tokens, wall seconds) of ``repeats`` passes over ``calls`` (warm the engine
    up first)."""
    tokens, started = 0, time.perf_counter()
    for _ in range(repeats):
        for call in calls:
            tokens += int(engine.rollout(*call).attention_mask.sum())
    return tokens, time.perf_counter() - started


def _worker(size: str, part: int, repeats: int, barrier: Any, out: Any) -> None:
    engine, calls = _calls(size, 2)
    engine.rollout(*calls[part])  # warm-up before the shared start
    barrier.wait()
    out.put(_sample(engine, calls[part : part + 1], repeats))


def measure(size: str, repeats: int) -> dict[str, Any]:
    """Tokens per second of the three layouts for one model size."""
    figures: dict[str, Any] = {"size": size, "repeats": repeats}
    for layout, parts in (("one", 1), ("halves", 2)):
        engine, calls = _calls(size, parts)
        engine.rollout(*calls[0])  # warm-up
        tokens, seconds = _sample(engine, calls, repeats)
        figures[layout] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(size, k, repeats, barrier, out)) for k in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get() for _ in procs]
    for p in procs:
        p.join()
    tokens = sum(t for t, _ in results)
    seconds = max(s for _, s in results)
    figures["parallel"] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}
    rate = {k: figures[k]["tokens_per_s"] for k in ("one", "halves", "parallel")}
    figures["parallel_over_one"] = rate["parallel"] / rate["one"]
    figures["one_over_halves"] = rate["one"] / rate["halves"]
    figures["parallel_over_halves"] = rate["parallel"] / rate["halves"]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sizes", nargs="+")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for size in args.sizes:
        f = measure(size, args.repeats)
        rows.append(f)
        print(
            f"{size}: one {f['one']['tokens_per_s']:.0f} tok/s, halves "
            f"{f['halves']['tokens_per_s']:.0f}, parallel {f['parallel']['tokens_per_s']:.0f}; "
            f"parallel/one {f['parallel_over_one']:.2f}x, one/halves "
            f"{f['one_over_halves']:.2f}x, parallel/halves {f['parallel_over_halves']:.2f}x",
            flush=True,
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
