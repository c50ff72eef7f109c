#!/usr/bin/env bash
# Depth 3 of the verl plug-in's tests on a GPU: verl 0.9.1's whole `main_ppo` with
# `trainer.v1.trainer_mode=anchor_rl` and the plug-in's `anchor_rl` rollout backend (anchor-rl's
# own sampler on CUDA, no vLLM), for PVPO, V0.5 (with its KL loss and a KL in its reward, to
# verl's reference worker) and VAPO (verl's critic; a KL in its reward), with FSDP2 and FSDP1,
# on anchor-rl's `base` model (50M, random) and an HF-format Llama written by benchmarks/make_hf_model.py (PVPO,
# FSDP2). Each run is the CPU tests' pair of launches (tests/integrations/verl_main_ppo.py, the
# same data and reward): steps 1-2 with a checkpoint, then a launch that resumes and runs step 3.
#
#   benchmarks/verl_gpu.sh OUT [--device cuda|cpu] [--runs "base-v05-fsdp2 ..."]
#       [--methods "pvpo v05 vapo"] [--strategies "fsdp2 fsdp"] [--models "base hf"]
#       [--jobs 1] [--rest-jobs N] [--launch-timeout 300] [--budget 480] [--work DIR] [--keep]
#
# Order: the runs go most informative first: base-v05-fsdp2 (actor, reference worker, both
# KLs, top-ups, the probe), base-vapo-fsdp (critic, FSDP1), base-pvpo-fsdp2 (teacher rows),
# hf-pvpo-fsdp2, base-v05-fsdp, base-vapo-fsdp2, base-pvpo-fsdp. `--runs` picks and orders runs
# by name (MODEL-METHOD-STRATEGY); otherwise --models/--methods/--strategies filter the list.
#
# Time: the first run goes alone, the others `--rest-jobs` at a time (default: `--jobs`, 1). A
# launch gets `--launch-timeout` seconds; then every Python process of it prints its threads'
# stacks (faulthandler on SIGUSR2, through a sitecustomize this script puts on PYTHONPATH) into
# OUT's logs and the launch is killed. No launch starts with under 60 s of `--budget` left,
# counted from this script's start (the install included); a launch never outlives the budget.
#
# Output, rewritten as each launch ends, so a run cut short still leaves its readings in OUT:
#   OUT/launches.jsonl  a line per finished launch: run, steps, return code, seconds, when the
#                       log reached "ready to fit" and each step, the log's tail on a failure
#   OUT/summary.json    per run: launches, checks, every step's metrics; the device's name
#   OUT/summary.md      the same as a table, failures' reasons below it
#   OUT/logs.tar.gz     per run: each launch's log, verl's metrics, the rewards scored, stacks
# A run's checks are the CPU depth-3 tests' (tests/integrations/verl_loop_checks.py), called on
# its outputs: the resume (steps, anchor_rl.pt, the anchor key), PVPO's presampling, group
# sampling and teacher rows, V0.5's prior, KL loss, top-ups, its KL in the reward and the replay
# of every optimizer step of its resumed step (verl_probe.py loaded in V0.5's and VAPO's
# launches), VAPO's critic metrics and its KL in the reward under its GAE, and the
# one-AdamW-step replay of the resumed actor (PVPO, VAPO) and critic (VAPO). Replays of FSDP1 checkpoints (flat parameters) map the flat optimizer state back to
# the named weights (verl_loop_checks.engine_state, tested on the CPU against torch's FSDP1 and
# verl's checkpoint manager by tests/integrations/test_verl_fsdp1.py). A run passes when both launches exit 0 and every check holds. Models,
# checkpoints and probe records stay in `--work` (a temporary folder by default); the
# checkpoints' and probe's weight files are deleted after a run's checks unless `--keep`.
#
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
VERL_GPU_START=$(date +%s.%N)
export VERL_GPU_START
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
    echo "installed into $site after $(python3 -c "import time; print(round(time.time() - $VERL_GPU_START))") s"
fi
export PYTHONUNBUFFERED=1
python3 - "$OUT" "$@" <<'PY'
import argparse
import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

# loading FSDP2 checkpoints (DTensors) warns once per tensor that no device mesh exists yet
logging.getLogger("torch.distributed.device_mesh").setLevel(logging.ERROR)
sys.path.insert(0, "tests/integrations")
import verl_main_ppo as loop  # noqa: E402

try:  # the CPU tests' checks (they import pytest): recorded as an error where they cannot load
    import verl_loop_checks as checks  # noqa: E402
except Exception:  # noqa: BLE001
    checks, CHECKS_ERROR = None, traceback.format_exc()[-1500:]

PRIORITY = [("v05", "fsdp2"), ("vapo", "fsdp"), ("pvpo", "fsdp2"), ("hf", "pvpo", "fsdp2"),
            ("v05", "fsdp"), ("vapo", "fsdp2"), ("pvpo", "fsdp")]  # fmt: skip
"""Most informative first; an entry without a model is any model but `hf`."""
MIN_LEFT, GRACE = 60.0, 20.0
"""No launch starts with under MIN_LEFT s of budget; a launch's own kill comes GRACE s after
its stacks are dumped."""

parser = argparse.ArgumentParser()
parser.add_argument("out", type=Path)
parser.add_argument("--device", default="cuda", choices=loop.DEVICES)
parser.add_argument("--runs", help="run names MODEL-METHOD-STRATEGY, in the order to run them")
parser.add_argument("--methods", default="pvpo v05 vapo")
parser.add_argument("--strategies", default="fsdp2 fsdp")
parser.add_argument("--models", default="base hf")
parser.add_argument("--jobs", type=int, default=1, help="runs at once")
parser.add_argument("--rest-jobs", type=int, help="runs at once after the first (default --jobs)")
parser.add_argument("--launch-timeout", type=float, default=300)
parser.add_argument("--budget", type=float, default=480, help="seconds from the script's start")
parser.add_argument("--work", type=Path, help="the runs' folders (default: a new temporary one)")
parser.add_argument("--keep", action="store_true", help="keep checkpoints and probe records")
args = parser.parse_args()
out = args.out.resolve()
work = (args.work or Path(tempfile.mkdtemp(prefix="verl_gpu_"))).resolve()
work.mkdir(parents=True, exist_ok=True)
start_wall = float(os.environ.get("VERL_GPU_START", time.time()))
start = time.monotonic() - (time.time() - start_wall)
deadline = start + args.budget
if args.device == "cuda" and not torch.cuda.is_available():
    sys.exit("--device cuda: torch sees no GPU")
device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"


def priority(run: tuple[str, str, str]) -> int:
    model, method, strategy = run
    key = (model, method, strategy) if model == "hf" else (method, strategy)
    return PRIORITY.index(key) if key in PRIORITY else len(PRIORITY)


if args.runs:
    runs = [tuple(name.split("-")) for name in args.runs.split()]
    bad = [r for r in runs if len(r) != 3 or r[1] not in loop.METHOD_OVERRIDES
           or r[2] not in loop.STRATEGIES]  # fmt: skip
    if bad:
        sys.exit(f"--runs: not MODEL-METHOD-STRATEGY: {bad}")
else:
    runs = sorted(
        ((model, method, strategy) for model in args.models.split()
         for method in args.methods.split() for strategy in args.strategies.split()
         if model != "hf" or (method, strategy) == ("pvpo", "fsdp2")),  # the HF Llama: one run
        key=priority,
    )  # fmt: skip
if args.device == "cpu" and any(r[2] != "fsdp2" for r in runs):
    print("--device cpu: the CPU mode runs FSDP2 only; FSDP1 runs dropped", flush=True)
    runs = [r for r in runs if r[2] == "fsdp2"]

# every Python process of a launch dumps its threads' stacks on SIGUSR2 (to its stderr: the
# launch's log for the driver, Ray's worker-*.err files for the workers)
hooks = work / "_hooks"
hooks.mkdir(exist_ok=True)
(hooks / "sitecustomize.py").write_text(
    "import faulthandler, importlib.util, os, signal, sys\n"
    "faulthandler.register(signal.SIGUSR2, all_threads=True)\n"
    "# the environment's own sitecustomize, which this one shadows, still runs\n"
    "for p in sys.path:\n"
    "    f = os.path.join(p or '.', 'sitecustomize.py')\n"
    "    if os.path.isfile(f) and os.path.abspath(f) != os.path.abspath(__file__):\n"
    "        spec = importlib.util.spec_from_file_location('_sitecustomize_next', f)\n"
    "        spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
    "        break\n"
)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(hooks), os.environ.get("PYTHONPATH")) if p
)
os.environ["PYTHONFAULTHANDLER"] = "1"  # and on a crash

results: dict[str, dict] = {}
lock, checks_lock = threading.Lock(), threading.Lock()


def name_of(run) -> str:
    return "-".join(run)


def elapsed() -> float:
    return round(time.monotonic() - start, 1)


def write_outputs(finished: bool = False) -> None:
    """summary.json, summary.md and logs.tar.gz as they stand (atomically replaced)."""
    with lock:
        done = [results[name_of(r)] for r in runs if name_of(r) in results]
        passed = [e["run"] for e in done if e.get("passed")]
        summary = {
            "device": args.device, "device_name": device_name, "torch": torch.__version__,
            "finished": finished, "seconds": elapsed(), "budget": args.budget,
            "launch_timeout": args.launch_timeout, "work": str(work),
            "order": [name_of(r) for r in runs], "passed": passed, "runs": done,
            **({"checks_unavailable": CHECKS_ERROR} if checks is None else {}),
        }  # fmt: skip
        tmp = out / ".summary.json.tmp"
        tmp.write_text(json.dumps(summary, indent=1, default=str))
        tmp.replace(out / "summary.json")
        tmp = out / ".summary.md.tmp"
        tmp.write_text(markdown(summary))
        tmp.replace(out / "summary.md")
        tmp = out / ".logs.tar.gz.tmp"
        with tarfile.open(tmp, "w:gz") as tar:
            for path in sorted(work.glob("*/*")):
                if path.parent.name.startswith("_"):
                    continue
                if path.suffix in (".txt", ".jsonl", ".tsv"):
                    tar.add(path, arcname=str(path.relative_to(work)))
        tmp.replace(out / "logs.tar.gz")


def describe(launch: dict) -> str:
    if "skipped" in launch:
        return launch["skipped"]
    phases = ", ".join(f"{k} {v}" for k, v in launch.get("phases", {}).items())
    rc = "timed out" if launch.get("timed_out") else f"rc {launch['returncode']}"
    return f"{rc}, {launch['seconds']} s" + (f" ({phases})" if phases else "")


def markdown(summary: dict) -> str:
    state = "" if summary["finished"] else ", still running or cut short"
    lines = [
        f"# benchmarks/verl_gpu.sh on {summary['device_name']} ({summary['device']})",
        "",
        f"{len(summary['passed'])} of {len(summary['order'])} runs passed; "
        f"{summary['seconds']} s of a {summary['budget']} s budget{state}; torch "
        f"{summary['torch']}. Times are seconds from each launch's start.",
        "",
        "| run | launch 1 (steps 1-2) | launch 2 (resume, step 3) | checks | verdict |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in summary["order"]:
        entry = next((e for e in summary["runs"] if e["run"] == name), None)
        if entry is None:
            lines.append(f"| {name} | not started | | | |")
            continue
        launches = [describe(x) for x in entry["launches"]] + ["", ""]
        found = entry.get("checks", {})
        ok = sum(v == "ok" for v in found.values())
        failed = [k for k, v in found.items() if v != "ok" and not v.startswith("skipped")]
        text = f"{ok}/{len(found)} ok" + (f"; failed: {', '.join(failed)}" if failed else "")
        verdict = (
            "passed" if entry.get("passed")
            else "running" if "passed" not in entry
            else "not run" if all("skipped" in x for x in entry["launches"])
            else "FAILED"
        )  # fmt: skip
        lines.append(f"| {name} | {launches[0]} | {launches[1]} | {text if found else ''} | "
                     f"{verdict} |")  # fmt: skip
    for entry in summary["runs"]:
        notes = [f"- {k}: {v}" for k, v in entry.get("checks", {}).items() if v != "ok"]
        if entry.get("error"):
            notes.append("```\n" + entry["error"][-2500:] + "\n```")
        if notes:
            lines += ["", f"## {entry['run']}", "", *notes]
    if "checks_unavailable" in summary:
        lines += ["", "## checks not loaded", "", "```", summary["checks_unavailable"], "```"]
    return "\n".join(lines) + "\n"


def launch_pids(marker: str) -> list[int]:
    """The processes of one launch: every one carries its metrics path in its environment."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes().split(b"\0"):
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def dump_stacks(marker: str, path: Path, seconds: float) -> None:
    """Every Python process of the launch prints its threads' stacks; their tails go to path."""
    procs = []
    for pid in launch_pids(marker):
        try:
            exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            err = os.readlink(f"/proc/{pid}/fd/2")
        except OSError:
            continue
        if exe.startswith("python"):
            procs.append((pid, cmd, err))
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGUSR2)
    text = [f"# stacks of {len(procs)} Python processes, {seconds:.0f} s into the launch"]
    if shutil.which("nvidia-smi"):
        smi = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                              "--format=csv"], capture_output=True, text=True)  # fmt: skip
        text.append(smi.stdout.strip())
    time.sleep(5)
    for pid, cmd, err in procs:
        text.append(f"\n## pid {pid}: {cmd}  (stderr: {err})")
        if err.startswith("/") and os.path.isfile(err):
            with open(err, "rb") as f:
                f.seek(max(0, os.path.getsize(err) - 6000))
                text.append(f.read().decode(errors="replace"))
    path.write_text("\n".join(text))


def kill_all(marker: str) -> None:
    for pid in launch_pids(marker):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


PHASES = [("ready", re.compile(r"ready to fit")), ("step", re.compile(r"\bstep:(\d+) - "))]


def one_launch(folder: Path, method: str, steps: int, strategy: str, timeout: float) -> dict:
    """One launch, watched: the seconds at which its log reached verl's "ready to fit" and each
    step; past ``timeout`` its processes' stacks go to stacks_<method>_<steps>.txt and it is
    killed."""
    tag = f"{method}_{steps}"
    marker = f"VERL_FILE_LOGGER_PATH={folder}/metrics_{tag}.jsonl"
    log = folder / f"log_{tag}.txt"
    done: dict = {}

    def target() -> None:
        done["result"] = loop.launch(folder, method, steps, timeout=timeout + GRACE,
                                     device=args.device, strategy=strategy,
                                     probe=method in ("v05", "vapo"))  # fmt: skip

    t0 = time.monotonic()
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    phases: dict[str, float] = {}
    offset, rest, timed_out = 0, "", False
    while thread.is_alive():
        thread.join(1.0)
        now = time.monotonic() - t0
        if log.exists():
            with open(log, errors="replace") as f:
                f.seek(offset)
                chunk = f.read()
                offset = f.tell()
            *lines, rest = (rest + chunk).split("\n")
            for line in lines:
                for key, pattern in PHASES:
                    match = pattern.search(line)
                    if match:
                        name = key + (match.group(1) if match.groups() else "")
                        phases.setdefault(name, round(now, 1))
        if not timed_out and now > timeout and thread.is_alive():
            timed_out = True
            dump_stacks(marker, folder / f"stacks_{tag}.txt", now)
            kill_all(marker)
    kill_all(marker)  # anything of Ray's left behind
    result = done.get("result")
    record = {"steps": steps, "returncode": 124 if timed_out else result.returncode,
              "seconds": round(time.monotonic() - t0, 1), "timed_out": timed_out,
              "phases": phases}  # fmt: skip
    if record["returncode"] != 0 and result is not None:
        lines = [x for x in result.stdout.splitlines() if "Warning" not in x]
        record["tail"] = "\n".join(lines[-40:])[-4000:]
    return record


def expect_checks(folder: Path, method: str, strategy: str) -> dict[str, object]:
    """The CPU tests' checks that apply to one run's outputs, by name."""
    runs_ = checks.Runs.__new__(checks.Runs)
    runs_.out, runs_.method, runs_.folder = folder, method, folder / "checkpoints" / method
    runs_.metrics = {**loop.metrics(folder, method, 2), **loop.metrics(folder, method, 3)}
    step = {k: runs_.folder / f"global_step_{k}" for k in (2, 3)}
    found = {"resume": lambda: checks.check_resumed(runs_)}
    if method == "pvpo":
        found["presampled"] = lambda: checks.check_presampled(runs_)
        found["pvpo_loop"] = lambda: checks.test_pvpo_through_main_ppo(runs_)
    if method == "v05":
        found["presampled"] = lambda: checks.check_presampled(runs_)
        found["v05_loop"] = lambda: checks.test_v05_through_main_ppo(runs_)
        found["top_ups"] = lambda: checks.test_v05_tops_up_through_verls_agent_loop(runs_)
        found["kl_in_reward"] = lambda: checks.test_v05_reward_carries_the_kl_to_the_reference(
            runs_
        )
        found["replay_actor_steps"] = lambda: (
            checks.test_v05_resumed_actor_replays_every_optimizer_step(runs_)
        )
    if method == "vapo":
        found["vapo_loop"] = lambda: checks.test_vapo_through_main_ppo(runs_)
        found["kl_in_reward"] = lambda: checks.test_vapo_reward_carries_the_kl_to_the_reference(
            runs_
        )
    for role in {"pvpo": ["actor"], "vapo": ["actor", "critic"]}.get(method, []):
        found[f"replay_{role}"] = lambda role=role: checks.check_resumed_engine(
            step[2] / role, step[3] / role
        )
    return found


def run_checks(folder: Path, method: str, strategy: str) -> dict[str, str]:
    """Each check's outcome: "ok", or its error."""
    if checks is None:
        return {"checks": "skipped: verl_loop_checks did not import (summary: checks_unavailable)"}
    result = {}
    with checks_lock:  # one run's checks at a time (FSDP1's flat state: checks.engine_state)
        for name, check in expect_checks(folder, method, strategy).items():
            try:
                if strategy == "fsdp":
                    checks.fsdp1_ready()
                check()
                result[name] = "ok"
            except Exception as e:  # noqa: BLE001  (recorded, not raised)
                text = f"{type(e).__name__}: {e}".strip()
                result[name] = (text if len(text) > 30 else traceback.format_exc())[-800:]
    return result


MODELS: dict[str, Path] = {}


def model_folder(model: str) -> Path:
    """The model of `model`, written once into work/_model_<model>/model."""
    with lock:
        if model in MODELS:
            return MODELS[model]
        folder = work / f"_model_{model}"
        if model == "hf":
            if not (folder / "model" / "config.json").exists():
                folder.mkdir(parents=True, exist_ok=True)
                subprocess.run(
                    [sys.executable, "benchmarks/make_hf_model.py", str(folder / "model"),
                     "--hidden", "512", "--layers", "4", "--heads", "8", "--kv-heads", "4",
                     "--intermediate", "1408"], check=True, capture_output=True, text=True,
                )  # fmt: skip
        else:
            loop.prepare(folder, model)
        MODELS[model] = folder / "model"
        return MODELS[model]


def one(run: tuple[str, str, str]) -> dict:
    model, method, strategy = run
    name = name_of(run)
    folder = work / name
    entry = {"run": name, "model": model, "method": method, "strategy": strategy,
             "started_at": elapsed(), "launches": []}  # fmt: skip
    with lock:
        results[name] = entry
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not (folder / "model").exists():
            (folder / "model").symlink_to(model_folder(model))
        loop.prepare(folder, model)
        for steps in (2, 3):
            left = deadline - time.monotonic()
            if left < MIN_LEFT:
                entry["launches"].append({"steps": steps, "skipped": "out of budget"})
                break
            record = one_launch(folder, method, steps, strategy,
                                timeout=min(args.launch_timeout, left - GRACE))  # fmt: skip
            entry["launches"].append(record)
            with open(out / "launches.jsonl", "a") as f:
                f.write(json.dumps({"run": name, "at": elapsed(), **record}) + "\n")
            write_outputs()
            if record["returncode"] != 0:
                break
        if [x.get("returncode") for x in entry["launches"]] == [0, 0]:
            entry["checks"] = run_checks(folder, method, strategy)
        entry["metrics"] = {**loop.metrics(folder, method, 2), **loop.metrics(folder, method, 3)}
    except Exception:  # noqa: BLE001  (recorded, not raised)
        entry["error"] = traceback.format_exc()[-3000:]
    entry["passed"] = (
        "error" not in entry
        and [x.get("returncode") for x in entry["launches"]] == [0, 0]
        and all(v == "ok" or v.startswith("skipped") for v in entry.get("checks", {}).values())
    )
    entry["seconds"] = round(elapsed() - entry["started_at"], 1)
    if not args.keep:
        for path in [*folder.glob("checkpoints/*/global_step_*/*/*.pt"),
                     *folder.glob("probe_*/optim_*.pt")]:  # fmt: skip
            path.unlink()
    print(f"[{elapsed()} s] {name}", "passed" if entry["passed"] else "FAILED",
          [describe(x) for x in entry["launches"]], entry.get("checks", ""), flush=True)  # fmt: skip
    write_outputs()
    return entry


print(f"{len(runs)} runs on {device_name}, in order:", " ".join(map(name_of, runs)), flush=True)
write_outputs()
if runs:
    one(runs[0])
    with ThreadPoolExecutor(max_workers=max(1, args.rest_jobs or args.jobs)) as pool:
        list(pool.map(one, runs[1:]))
write_outputs(finished=True)
passed = sum(bool(results[name_of(r)].get("passed")) for r in runs)
print((out / "summary.md").read_text())
print(f"{passed}/{len(runs)} runs passed in {elapsed()} s;", out / "summary.md")
sys.exit(0 if passed == len(runs) else 1)
PY
