"""Torch threads per phase: an SFT step, a GRPO step's generation and its update, for each
model size at each thread count, on an idle machine and with every core busy.

"Busy" starts one ``python -c "while True: pass"`` process per core this process may use
(each a pure-Python spin, nice 0, as another user's job would be) and kills them after the
measurements. Each figure is the median seconds of ``--repeats`` calls after one warm-up;
the thread counts alternate within each repeat, so a drift in the machine's load reaches
them alike. The GRPO step is the ``grpo`` preset's (8 prompts x 8 responses, at most 80
tokens, KL on) on a random-init model with ``optim.lr=0`` (the policy, and so the
responses, stay the same every step); the SFT step is forward, backward, clipping and AdamW
on a batch of 32 arithmetic traces, as ``anchor-rl sft`` takes it. What the ``auto`` setting
of :mod:`anchor_rl.threads` chose for each size is shown beside the table.

    python benchmarks/threads.py                       # tiny and small, 1 and 2 threads
    python benchmarks/threads.py --quick               # tiny only, 2 repeats: a smoke test
    python benchmarks/threads.py --sizes tiny small base --repeats 5 --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from _common import emit  # noqa: E402

PHASES = ("sft", "generate", "update")


@contextlib.contextmanager
def busy_cores(count: int) -> Iterator[list[int]]:
    """``count`` spinning Python processes for the block; yields their pids."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.5)  # let them reach the scheduler
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def sft_step_call(size: str) -> Callable[[], None]:
    """One SFT optimiser step of a random-init ``size`` model on 32 arithmetic traces."""
    import torch

    from anchor_rl.models.factory import build_model
    from anchor_rl.models.sft import collate, sft_example, sft_loss
    from anchor_rl.models.tokenizer import build_tokenizer
    from anchor_rl.tasks import get_task

    tokenizer = build_tokenizer()
    task = get_task("arithmetic")
    examples = [sft_example(tokenizer, task, r) for r in task.records("train")[:32]]
    batch = collate(examples, tokenizer.pad_token_id)
    model = build_model(size, tokenizer, seed=0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        loss = sft_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def grpo_run(size: str, run_dir: Path, threads: int) -> Any:
    """A ``grpo`` run of a random-init ``size`` model whose steps do not change it."""
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.run import start_run

    cfg = load_config(
        "grpo",
        [f"model=random:{size}", "optim.lr=0", "eval.every=0", "checkpoint.every=0",
         "log.tensorboard=false", "log.progress=false", f"threads={threads}", "steps=1000"],
    )  # fmt: skip
    return start_run(cfg, run_dir)


def measure(sizes: list[str], counts: list[int], repeats: int) -> dict[str, dict[str, float]]:
    """``{"SIZE/THREADS": {"sft": s, "generate": s, "update": s}}``: median seconds."""
    import dataclasses

    import torch

    from anchor_rl import threads
    from anchor_rl.trainer.loop import train_step

    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        sft = sft_step_call(size)
        with tempfile.TemporaryDirectory() as tmp:
            run = grpo_run(size, Path(tmp), counts[0])
            times: dict[int, dict[str, list[float]]] = {n: {p: [] for p in PHASES} for n in counts}
            for r in range(repeats + 1):  # the first round warms up
                for n in counts:
                    threads.configure(n)
                    run.threads = dataclasses.replace(run.threads, generate=n, update=n, sft=n)
                    torch.set_num_threads(n)
                    started = time.perf_counter()
                    sft()
                    sft_s = time.perf_counter() - started
                    metrics = train_step(run)
                    if r:
                        times[n]["sft"].append(sft_s)
                        times[n]["generate"].append(metrics["time/generate"])
                        times[n]["update"].append(metrics["time/update"])
                    print(
                        f"{size}, {n} thread(s), {'repeat ' + str(r) if r else 'warm-up'}: "
                        f"sft {sft_s:.3f} s, generate {metrics['time/generate']:.3f} s, "
                        f"update {metrics['time/update']:.3f} s",
                        file=sys.stderr, flush=True,
                    )  # fmt: skip
            run.close()
        for n in counts:
            out[f"{size}/{n}"] = {p: statistics.median(v) for p, v in times[n].items()}
    return out


def auto_choices(sizes: list[str]) -> dict[str, str]:
    """What ``threads=auto`` picks for each size on this machine (``$OMP_NUM_THREADS`` unset)."""
    from anchor_rl.models.factory import build_model
    from anchor_rl.models.tokenizer import build_tokenizer
    from anchor_rl.threads import choose_threads, parameter_count

    tokenizer = build_tokenizer()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = {}
    for size in sizes:
        params = parameter_count(build_model(size, tokenizer, seed=0))
        choice = choose_threads(params, "auto", environ=env)
        out[size] = f"{params / 1e6:.1f}M: " + choice.line(("sft", "generate", "update"))
    return out


def table(results: dict[str, dict[str, dict[str, float]]], counts: list[int]) -> str:
    """A markdown table: one row per load, size and thread count; seconds and the slowdown
    against the fastest count of the same load, size and phase."""
    lines = [
        "| load | size | threads | SFT step s | generate s | update s |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for load, rows in results.items():
        for key, phases in rows.items():
            size, n = key.split("/")
            cells = []
            for p in PHASES:
                best = min(rows[f"{size}/{c}"][p] for c in counts)
                ratio = phases[p] / best
                cells.append(f"{phases[p]:.3f}" + (f" ({ratio:.1f}x)" if ratio >= 1.05 else ""))
            lines.append(f"| {load} | {size} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--loads", nargs="+", choices=["idle", "busy"], default=["idle", "busy"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny only, 2 repeats")
    parser.add_argument("--out", type=Path, help="also write the results as JSON here")
    args = parser.parse_args()
    if args.quick:
        args.sizes, args.repeats = ["tiny"], 2
    import torch

    from anchor_rl.threads import available_cores

    cores = available_cores()
    load_before = os.getloadavg()[0]
    results: dict[str, Any] = {}
    for load in args.loads:
        spinners = cores if load == "busy" else 0
        with busy_cores(spinners):
            results[load] = measure(args.sizes, args.threads, args.repeats)
    print(table(results, args.threads))
    auto = auto_choices(args.sizes)
    for size, line in auto.items():
        print(f"auto, {size} ({line})")
    host = {"cores": cores, "cpu": _cpu_name(), "torch": torch.__version__,
            "load_before": load_before, "repeats": args.repeats}  # fmt: skip
    if args.out:
        emit({"host": host, "seconds": results, "auto": auto}, args.out)


def _cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
