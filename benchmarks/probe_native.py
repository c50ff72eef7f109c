"""Where a GRPO step's CPU time goes below Python: the native functions Linux ``perf`` samples
while one phase of the step runs over and over, summed into a few kinds of work.

    OMP_NUM_THREADS=1 python benchmarks/probe_native.py sft:tiny --seconds 8 --out FILE
    OMP_NUM_THREADS=1 python benchmarks/probe_native.py sft:tiny --seconds 8 --out FILE \
        optim.autocast=bf16 rollout.engine_args.precision=bf16

A run of the ``trl`` suite's step (8 prompts x 8 responses of the arithmetic task, up to 80
new tokens) is set up and warmed with three steps; then each phase -- ``generate`` (the
rollouts), ``reference`` (the reference's log-probs), ``update`` (the policy's forward,
backward and optimizer step on one batch, repeated) -- runs in a loop while ``perf record
-e cpu-clock`` samples this process for ``--seconds``. ``perf report`` gives each native
function's share of the samples, and :func:`kind` sorts the functions into matrix products,
attention kernels, element-wise kernels, copies, the Python interpreter, PyTorch's dispatch
and bindings, the allocator and the OS. Needs ``perf`` on the PATH (a CPU-clock event, so no
hardware counters are needed). Prints JSON (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = (
    "matrix products",
    "matrix-vector products",
    "attention kernels",
    "element-wise kernels and reductions",
    "copies",
    "Python interpreter",
    "dispatch, bindings, bookkeeping",
    "allocator",
    "OS kernel",
    "other",
)
"""The kinds of work :func:`kind` tells apart, in the order the JSON lists them."""

_ALLOCATOR = re.compile(r"^(_int_malloc|_int_free|malloc|free|cfree|malloc_consolidate|"
                        r"unlink_chunk.*|_int_memalign|posix_memalign|__libc_.*alloc.*)$")  # fmt: skip


def kind(dso: str, symbol: str) -> str:
    """The kind of work of native function ``symbol`` in shared object ``dso`` (names as
    ``perf report`` prints them; one of :data:`KINDS`)."""
    if dso.startswith("[kernel"):
        return "OS kernel"
    if "python3" in dso and dso.startswith("libpython"):
        return "Python interpreter"
    if _ALLOCATOR.match(symbol):
        return "allocator"
    if "gemv" in symbol:
        return "matrix-vector products"
    if "gemm" in symbol or dso.startswith(("[JIT]", "[unknown]")):
        return "matrix products"  # MKL's GEMM; oneDNN's JIT-generated kernels have no symbol
    if "flash_attention" in symbol:
        return "attention kernels"
    if "copy_kernel" in symbol or "memmove" in symbol or "memcpy" in symbol:
        return "copies"
    loops = ("VectorizedLoop2d", "_kernel", "Sleef_", "vectorized_", "vec::", "serial_for_each")
    if any(k in symbol for k in loops) or symbol.startswith(
        "at::native::(anonymous namespace)::cpu_"
    ):
        return "element-wise kernels and reductions"
    if dso.startswith(("libtorch", "libc10")) or dso.startswith("libc.so"):
        return "dispatch, bindings, bookkeeping"
    return "other"


def short(symbol: str) -> str:
    """A readable name for ``symbol``: an ATen loop template's kernel (``mul_kernel (AVX2)``),
    else the symbol cut to 100 characters."""
    kernel = re.search(
        r"(?:native::)?(?:(AVX\w*)::)?(?:\(anonymous namespace\)::)?(\w+_kernel\w*)", symbol
    )
    if kernel and ("Loop2d<" in symbol or "loop_2d_from_1d<" in symbol):
        isa = re.search(r"native::(AVX\w*)::", symbol)
        return kernel[2] + (f" ({isa[1]})" if isa else "")
    return symbol[:100]


def parse_report(text: str) -> list[tuple[float, str, str]]:
    """``(percent, dso, symbol)`` rows of ``perf report --stdio --no-children --sort
    dso,sym`` output (comment and blank lines skipped)."""
    rows = []
    for line in text.splitlines():
        match = re.match(r"\s*([\d.]+)%\s+(.+?)\s+\[[.k]\]\s+(.*)$", line)
        if match:
            rows.append((float(match[1]), match[2], match[3].strip()))
    return rows


def summarise(
    rows: list[tuple[float, str, str]], top: int = 12, per_kind: int = 4
) -> dict[str, Any]:
    """Each kind's share of the samples (percent), the ``top`` functions, and each kind's
    ``per_kind`` largest functions (``"percent dso: name"``)."""
    shares = dict.fromkeys(KINDS, 0.0)
    largest: dict[str, list[str]] = {k: [] for k in KINDS}
    ordered = sorted(rows, reverse=True)
    for percent, dso, symbol in ordered:
        group = kind(dso, symbol)
        shares[group] += percent
        if len(largest[group]) < per_kind:
            largest[group].append(f"{percent:.2f} {dso}: {short(symbol)}")
    return {
        "kinds": {k: round(v, 2) for k, v in shares.items()},
        "top": [
            {"percent": p, "dso": d, "symbol": short(s), "kind": kind(d, s)}
            for p, d, s in ordered[:top]
        ],
        "largest_by_kind": largest,
    }


def record(work: Callable[[], Any], seconds: float, perf: str) -> dict[str, Any]:
    """Run ``work`` in a loop while ``perf`` samples this process for ``seconds``."""
    with tempfile.TemporaryDirectory(prefix="probe-native-") as folder:
        data = str(Path(folder) / "perf.data")
        command = [perf, "record", "-F", "2000", "-e", "cpu-clock", "-o", data]
        sampler = subprocess.Popen(
            [*command, "-p", str(os.getpid()), "--", "sleep", str(seconds)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        done, calls = threading.Event(), 0

        def stop_when_sampled() -> None:
            sampler.wait()
            done.set()

        threading.Thread(target=stop_when_sampled, daemon=True).start()
        time.sleep(0.5)  # perf attaches
        while not done.is_set():
            work()
            calls += 1
        if sampler.returncode != 0:
            raise RuntimeError(f"perf record failed: {sampler.stderr.read().decode()[-500:]}")
        report = subprocess.run(
            [perf, "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    return {"calls": calls} | summarise(parse_report(report))


def phases(
    model: str, overrides: list[str], run_dir: Path | None = None
) -> dict[str, Callable[[], Any]]:
    """The three phases of the ``trl`` suite's step on ``model``, as repeatable calls (the run
    in ``run_dir``, default a new temporary directory)."""
    from anchor_rl.trainer import loop, update
    from anchor_rl.trainer.collect import generate
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.run import start_run

    settings = [f"model={model}", "task=arithmetic", "rollout.prompts_per_step=8",
                "rollout.n=8", "rollout.max_new_tokens=80", "eval.every=0",
                "checkpoint.every=0", "log.tensorboard=false", "steps=100", *overrides]  # fmt: skip
    run_dir = run_dir or Path(tempfile.mkdtemp(prefix="probe-native-"))
    run = start_run(load_config("grpo", settings), run_dir)
    saved: dict[str, tuple] = {}
    originals = {name: getattr(loop, name) for name in ("score_logprobs", "ppo_update")}
    for name, original in originals.items():  # the loop's calls, kept to be made again

        def keep(*args, _name=name, _original=original, **kwargs):
            saved[_name] = (args, kwargs)
            return _original(*args, **kwargs)

        setattr(loop, name, keep)
    try:
        for _ in range(3):  # warm-up (oneDNN's primitives, the allocator's heap)
            loop.train_step(run)
            run.state.step += 1
    finally:
        for name, original in originals.items():
            setattr(loop, name, original)
    records = run.sampler.take(run.cfg.rollout.prompts_per_step)
    draws = list(range(1000, 1000 + len(records)))

    def reference() -> None:
        args, kwargs = saved["score_logprobs"]
        update.score_logprobs(*args, **kwargs)

    def step_update() -> None:
        args, kwargs = saved["ppo_update"]
        update.ppo_update(*args, **(kwargs | {"seen": {}}))

    return {
        "generate": lambda: generate(run.engine, run.task, records, draws, run.cfg),
        "reference": reference,
        "update": step_update,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_intermixed_args(argv)
    perf = shutil.which("perf")
    if perf is None:
        raise SystemExit("probe_native needs Linux perf on the PATH (e.g. the linux-perf package)")
    import torch

    result: dict[str, Any] = {
        "model": args.model,
        "overrides": args.overrides,
        "threads": torch.get_num_threads(),
        "seconds": args.seconds,
        "phases": {},
    }
    for name, work in phases(args.model, args.overrides).items():
        print(f"sampling {name} for {args.seconds:g} s", file=sys.stderr, flush=True)
        result["phases"][name] = record(work, args.seconds, perf)
    from _common import emit

    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
