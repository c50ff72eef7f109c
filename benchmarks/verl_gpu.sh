#!/usr/bin/env bash
# Depth 3 of the verl plug-in's tests on a GPU: verl 0.9.1's whole `main_ppo` with
# `trainer.v1.trainer_mode=anchor_rl` and the plug-in's `anchor_rl` rollout backend (anchor-rl's
# own sampler on CUDA, no vLLM), for PVPO, V0.5 (with its KL loss to verl's reference worker)
# and VAPO (verl's critic), with FSDP2 and FSDP1, on anchor-rl's `base` model (50M, random) and
# an HF-format Llama written by benchmarks/make_hf_model.py (PVPO, FSDP2). Each run is the
# CPU tests' pair of launches (tests/integrations/verl_main_ppo.py, the same data and reward):
# steps 1-2 with a checkpoint, then a launch that resumes and runs step 3.
#
#   benchmarks/verl_gpu.sh OUT [--device cuda|cpu] [--methods "pvpo v05 vapo"]
#       [--strategies "fsdp2 fsdp"] [--models "base hf"] [--jobs 0] [--launch-timeout 150]
#       [--budget 320]
#
# Writes OUT/summary.json (per run: each launch's return code and seconds, the steps logged,
# the checks below, the metrics of every step; the device's name) and OUT/logs.tar.gz (each
# launch's log, verl's metrics, the rewards scored), nothing else (models and checkpoints stay in
# `--work`, a temporary folder by default). A run's checks: both launches exit 0;
# steps 1-2 logged by the first, step 3 by the second; anchor_rl.pt at steps 2 and 3 holds the
# method and one anchors' key; V0.5's `actor/kl_loss` finite at every step and non-zero after
# an update; the resumed actor (PVPO, VAPO) and critic (VAPO) are the saved ones (one AdamW step
# from the step-2 checkpoint gives step 3's weights: tests/integrations/verl_loop_checks.py).
#
# Runs go `--jobs` at a time (0, the default: all 7 at once; one GPU holds them), each launch
# killed after `--launch-timeout` seconds and nothing started once `--budget` seconds have
# passed (the defaults end within 6 minutes).
# `--device cpu` is the dry run on a machine without a GPU: the plug-in's CPU mode, FSDP2 only
# (give it `--models tiny` and minutes per launch).
#
# Environment: verl and Ray importable, or, where they are not (the lent GPU machine: torch,
# transformers and peft, no verl, no Ray, no internet), carried in the git-ignored `.whl/` folder
# (the wheels docs/integrations.md "verl on a GPU without vLLM" lists, and Ray as
# `.whl/ray.tar.xz`, an unpacked wheel): they are installed with this tree into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ] || [ "${1#-}" != "$1" ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
OUT=$1
shift
mkdir -p "$OUT"
if ! python3 -c "import verl, ray, anchor_rl" 2>/dev/null; then
    if [ ! -d .whl ]; then
        echo "verl, ray or anchor_rl is not importable and there is no .whl/ folder" >&2
        exit 3
    fi
    site=/tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" .whl/*.whl || exit 3
    if [ -f .whl/ray.tar.xz ]; then
        tar xJf .whl/ray.tar.xz -C "$site" || exit 3
        chmod +x "$site/ray/core/src/ray/gcs/gcs_server" "$site/ray/core/src/ray/raylet/raylet"
    fi
    # this tree as a package: verl finds the plug-in through its `verl.plugins` entry point
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile \
        --no-cache-dir --target "$site" . || exit 3
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1
python3 - "$OUT" "$@" <<'PY'
import argparse
import json
import math
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, "tests/integrations")
import verl_loop_checks as checks  # noqa: E402
import verl_main_ppo as loop  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--device", default="cuda", choices=loop.DEVICES)
parser.add_argument("--methods", default="pvpo v05 vapo")
parser.add_argument("--strategies", default="fsdp2 fsdp")
parser.add_argument("--models", default="base hf")
parser.add_argument("--jobs", type=int, default=0, help="runs at once (0: all)")
parser.add_argument("--launch-timeout", type=float, default=150)
parser.add_argument("--budget", type=float, default=320)
parser.add_argument("--work", type=Path, help="the runs' folders (default: a new temporary one)")
args = parser.parse_args()
out = args.out.resolve()
work = (args.work or Path(tempfile.mkdtemp(prefix="verl_gpu_"))).resolve()
start = time.monotonic()
deadline = start + args.budget
if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit("--device cuda: torch sees no GPU")
device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"

runs = [
    (model, method, strategy)
    for model in args.models.split()
    for method in args.methods.split()
    for strategy in args.strategies.split()
    if model != "hf" or (method, strategy) == ("pvpo", "fsdp2")  # the HF Llama: one run
]


def run_checks(folder: Path, method: str) -> dict[str, str]:
    """Each check's outcome: "ok", or its error."""
    runs_ = checks.Runs.__new__(checks.Runs)
    runs_.out, runs_.method, runs_.folder = folder, method, folder / "checkpoints" / method
    runs_.metrics = {**loop.metrics(folder, method, 2), **loop.metrics(folder, method, 3)}
    found = {"resumed": lambda: checks.check_resumed(runs_)}
    if method == "v05":
        found["kl_loss"] = lambda: check_kl(runs_.metrics)
    for role in ("actor", "critic") if method == "vapo" else ("actor",) if method == "pvpo" else ():
        found[f"resumed_{role}"] = lambda role=role: checks.check_resumed_engine(
            runs_.folder / "global_step_2" / role, runs_.folder / "global_step_3" / role
        )
    result = {}
    for name, check in found.items():
        try:
            check()
            result[name] = "ok"
        except Exception as e:  # noqa: BLE001  (recorded, not raised)
            result[name] = f"{type(e).__name__}: {e}"[:500] or traceback.format_exc()[-500:]
    return result


def check_kl(metrics: dict[int, dict[str, float]]) -> None:
    values = [metrics[s]["actor/kl_loss"] for s in sorted(metrics)]
    assert all(math.isfinite(v) for v in values), values
    assert any(v > 0 for v in values[1:]), values  # after the first update


def one(model: str, method: str, strategy: str) -> dict:
    name = f"{model}-{method}-{strategy}"
    folder = work / name
    entry = {"model": model, "method": method, "strategy": strategy, "launches": []}
    try:
        if model == "hf" and not (folder / "model" / "config.json").exists():
            folder.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [sys.executable, "benchmarks/make_hf_model.py", str(folder / "model"),
                 "--hidden", "512", "--layers", "4", "--heads", "8", "--kv-heads", "4",
                 "--intermediate", "1408"], check=True, capture_output=True, text=True,
            )  # fmt: skip
        loop.prepare(folder, "base" if model == "hf" else model)
        for steps in (2, 3):
            left = deadline - time.monotonic()
            if left < 20:
                entry["launches"].append({"steps": steps, "skipped": "out of budget"})
                break
            t0 = time.monotonic()
            done = loop.launch(folder, method, steps, timeout=min(args.launch_timeout, left),
                               device=args.device, strategy=strategy)  # fmt: skip
            entry["launches"].append({"steps": steps, "returncode": done.returncode,
                                      "seconds": round(time.monotonic() - t0, 1)})  # fmt: skip
            if done.returncode != 0:
                entry["error"] = done.stdout[-3000:]
                break
        else:
            entry["checks"] = run_checks(folder, method)
        entry["metrics"] = {**loop.metrics(folder, method, 2), **loop.metrics(folder, method, 3)}
    except Exception:  # noqa: BLE001  (recorded, not raised)
        entry["error"] = traceback.format_exc()[-3000:]
    entry["passed"] = (
        "error" not in entry
        and [launch.get("returncode") for launch in entry["launches"]] == [0, 0]
        and all(v == "ok" for v in entry.get("checks", {}).values())
    )
    print(name, "passed" if entry["passed"] else "FAILED", entry["launches"], flush=True)
    return entry


with ThreadPoolExecutor(max_workers=args.jobs or len(runs)) as pool:
    results = list(pool.map(lambda r: one(*r), runs))
summary = {
    "device": args.device, "device_name": device_name, "torch": torch.__version__,
    "seconds": round(time.monotonic() - start, 1), "work": str(work), "runs": results,
    "passed": [f"{r['model']}-{r['method']}-{r['strategy']}" for r in results if r["passed"]],
}  # fmt: skip
(out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
with tarfile.open(out / "logs.tar.gz", "w:gz") as tar:
    for path in sorted(work.glob("*/*")):
        if path.suffix in (".txt", ".jsonl", ".tsv"):
            tar.add(path, arcname=str(path.relative_to(work)))
print(f"{len(summary['passed'])}/{len(results)} runs passed in {summary['seconds']} s;",
      out / "summary.json")  # fmt: skip
sys.exit(0 if len(summary["passed"]) == len(results) else 1)
PY
