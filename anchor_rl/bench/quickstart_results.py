"""The quickstart's raw results (``OUT/quickstart.json``), its verdict and its plot.

One compact JSON file holds everything the quickstart concludes, so a report can be rebuilt
from it alone (``anchor-rl report OUT`` reads it; ``docs/results/quickstart/`` commits one):
the command and settings, the machine (CPU name, cores, torch threads), the SFT reference's
stop step, each phase's seconds, and per run (PVPO in ``OUT``, GRPO in ``OUT/grpo``) its final
metrics, its held-out curve against steps, total rollouts and seconds, its training reward
per step, and its per-prompt held-out correctness at the first and last evaluation (packed
as a digit string, :func:`anchor_rl.trainer.logging.pack_counts`), with the paired
bootstrap of each gain and of PVPO's final accuracy minus GRPO's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RAW_FILE = "quickstart.json"
KIND, VERSION = "anchor-rl quickstart", 1
RUNS = {"pvpo": ("PVPO", "."), "grpo": ("GRPO", "grpo")}
"""Run name -> (label, directory inside the quickstart's)."""
CAVEAT = (
    "one seed; figures vary with the CPU (float results, and with them the SFT reference's "
    "weights and stop step, differ between CPUs)"
)
"""What one quickstart run cannot say, printed with every verdict."""
INTERVAL = "95% paired bootstrap over held-out prompts"


def collect(
    out: Path,
    command: str,
    seconds: Mapping[str, float],
    sft_dir: Path | None = None,
) -> dict[str, Any]:
    """The raw results of the finished quickstart in ``out`` (PVPO there, GRPO in
    ``out/grpo`` when it ran); ``seconds``: wall time of the phases (``sft``, ``setup``,
    ``total``); ``sft_dir``: the SFT reference's directory (its stop step is read there).
    ValueError when a run has no per-prompt held-out evaluation before and after training."""
    from anchor_rl import threads
    from anchor_rl.bench.host import host_info
    from anchor_rl.bench.summary import paired

    out = Path(out)
    config = json.loads((out / "config.json").read_text())
    runs = {
        n: _run(out / d, n) for n, (_, d) in RUNS.items() if (out / d / "config.json").is_file()
    }
    comparisons = paired({n: [held_out_pair(r)] for n, r in runs.items()}, "grpo")
    for name, run in runs.items():
        run["gain"] = comparisons["gain"][name]
    final, host = runs["pvpo"]["final"], host_info("cpu")
    raw: dict[str, Any] = {
        "kind": KIND,
        "version": VERSION,
        "command": command,
        "task": config["task"],
        "model": config["model"],
        "seed": config["seed"],
        "settings": {
            "steps": config["steps"],
            "train_prompts": config["train_prompts"],
            "prompts_per_step": config["rollout"]["prompts_per_step"],
            "n": config["rollout"]["n"],
            "m": config["pvpo"]["m"],
            "eval_prompts": config["eval"]["prompts"],
            "eval_every": config["eval"]["every"],
            "lr": config["optim"]["lr"],
            "kl_coef": config["kl"]["coef"],
        },
        "host": {
            "cpu": host["device_name"],
            "cores": threads.available_cores(),
            "threads_setting": config.get("threads", "auto"),
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": {
                p: int(final[f"threads/{p}"])
                for p in ("generate", "update")
                if f"threads/{p}" in final
            },
            "torch": host["versions"]["torch"],
            "python": host["python"],
        },
        "sft": _sft(sft_dir, seconds.get("sft", 0.0)),
        "seconds": {k: round(float(v), 1) for k, v in seconds.items()},
        "filter": _filter(out),
        "runs": runs,
    }
    if "pvpo" in comparisons["vs_baseline"]:
        raw["pvpo_minus_grpo"] = comparisons["vs_baseline"]["pvpo"]
    return raw


def _run(run_dir: Path, name: str) -> dict[str, Any]:
    from anchor_rl.trainer.logging import pack_counts, read_evals, read_metrics

    records = read_metrics(run_dir)
    evals = [r for r in records if "eval/accuracy" in r]
    tests = {e["step"]: e["test"] for e in read_evals(run_dir) if "test" in e}
    if not evals or 0 not in tests or len(tests) < 2:
        raise ValueError(
            f"{run_dir} has no per-prompt held-out evaluation before and after training "
            "(the quickstart needs eval.every > 0)"
        )
    last = records[-1]
    policy = last["rollouts/cumulative"]
    run = {
        "preset": json.loads((run_dir / "config.json").read_text()).get("preset"),
        "dir": RUNS[name][1],
        "steps": int(last["step"]),
        "before": evals[0]["eval/accuracy"],
        "after": evals[-1]["eval/accuracy"],
        "rollouts_policy": policy,
        "rollouts_presample": last.get("rollouts/presample", 0.0),
        "rollouts_total": last.get("rollouts/total", policy),
        "seconds": round(last["time/elapsed"], 1),
        "final": {k: _short(v) for k, v in last.items()},
        "curve": [
            [
                int(r["step"]),
                r.get("rollouts/total", r["rollouts/cumulative"]),
                round(r["time/elapsed"], 1),
                r["eval/accuracy"],
            ]
            for r in evals
        ],
        "reward": [
            [int(r["step"]), _short(r["reward/mean"])] for r in records if "reward/mean" in r
        ],
        "held_out": {
            "steps": [0, max(tests)],
            "before": pack_counts(tests[0]),
            "after": pack_counts(tests[max(tests)]),
        },
    }
    train = [r["eval/train_accuracy"] for r in evals if "eval/train_accuracy" in r]
    if train:
        run["train_before"], run["train_after"] = train[0], train[-1]
    return run


def held_out_pair(run: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A run's per-prompt held-out accuracy before and after training, from its raw results
    (what :func:`anchor_rl.bench.summary.paired` takes)."""
    return _accuracy(run["held_out"]["before"]), _accuracy(run["held_out"]["after"])


def _accuracy(entry: Mapping[str, Any]) -> dict[str, float]:
    """Per-prompt accuracy (correct / k) of a packed or plain evaluation entry."""
    from anchor_rl.trainer.logging import unpack_counts

    entry = unpack_counts(entry) if "counts" in entry else entry
    return {pid: c / entry["k"] for pid, c in entry["correct"].items()}


def _sft(sft_dir: Path | None, seconds: float) -> dict[str, Any] | None:
    """The SFT reference's stop: the step it kept, the steps it trained (at most how many) and
    its validation evaluations."""
    if sft_dir is None:
        return None
    sft_dir = Path(sft_dir)
    out: dict[str, Any] = {"seconds": round(float(seconds), 1)}
    meta = sft_dir / "sft_config.json"
    if meta.is_file():
        out["max_steps"] = json.loads(meta.read_text()).get("steps")
    if (sft_dir / "loss.json").is_file():
        out["trained_steps"] = len(json.loads((sft_dir / "loss.json").read_text()))
    if (sft_dir / "class_stop.json").is_file():
        stop = json.loads((sft_dir / "class_stop.json").read_text())
        out["kept_step"], out["evaluations"] = stop["kept_step"], len(stop["evaluations"])
    return out


def _filter(out: Path) -> dict[str, Any] | None:
    path = out / "pvpo_filter.json"
    return json.loads(path.read_text())["fractions"] if path.is_file() else None


def _short(value: Any) -> Any:
    """A float to 6 significant digits."""
    return float(f"{value:.6g}") if isinstance(value, float) else value


def write_raw(out: Path, raw: Mapping[str, Any]) -> Path:
    """``out/quickstart.json``: one object per line of the top level, no indentation below."""
    lines = [f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in raw.items()]
    path = Path(out) / RAW_FILE
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return path


def is_raw(payload: Any) -> bool:
    """Whether a parsed JSON file is a quickstart's raw results."""
    return isinstance(payload, dict) and payload.get("kind") == KIND


# --- what the results say -------------------------------------------------------------------


def verdict(d: Mapping[str, Any]) -> str:
    """What PVPO minus GRPO's interval ``d`` (``low``, ``high``) lets one run say."""
    if d["low"] > 0:
        return "PVPO ended ahead of GRPO in this run (the interval lies above 0)"
    if d["high"] < 0:
        return "PVPO ended behind GRPO in this run (the interval lies below 0)"
    return "this run cannot tell PVPO and GRPO apart (the interval covers 0)"


def accuracy_line(raw: Mapping[str, Any], name: str, arrow: str = "→") -> str:
    """``PVPO held-out accuracy 0.571 → 0.641 (1000 prompts; 3968 rollouts, 2048 of them
    presampling; 33 s)``."""
    r = raw["runs"][name]
    pre = r["rollouts_presample"]
    rollouts = f"{r['rollouts_total']:.0f} rollouts" + (
        f", {pre:.0f} of them presampling" if pre else ""
    )
    prompts = r["gain"]["prompts"] if r.get("gain") else raw["settings"]["eval_prompts"]
    return (
        f"{RUNS[name][0]} held-out accuracy {r['before']:.3f} {arrow} {r['after']:.3f} "
        f"({prompts} prompts; {rollouts}; {r['seconds']:.0f} s)"
    )


def headline(raw: Mapping[str, Any], arrow: str = "→") -> str:
    """One paragraph: each run's held-out accuracy before and after by name, PVPO minus GRPO
    with its interval and what the interval lets this run say, and :data:`CAVEAT`."""
    from anchor_rl.bench.summary import format_bootstrap

    accuracies = []
    for name in (n for n in RUNS if n in raw["runs"]):
        r = raw["runs"][name]
        pre = r["rollouts_presample"]
        rollouts = f"{r['rollouts_total']:.0f} rollouts" + (
            f", {pre:.0f} of them presampling" if pre else ""
        )
        accuracies.append(
            f"{RUNS[name][0]} {r['before']:.3f} {arrow} {r['after']:.3f} ({rollouts})"
        )
    text = (
        f"Held-out accuracy on {raw['settings']['eval_prompts']} prompts, before {arrow} after "
        f"training: {', '.join(accuracies)}."
    )
    if "pvpo_minus_grpo" in raw:
        d = raw["pvpo_minus_grpo"]
        text += (
            f" PVPO minus GRPO after training: {format_bootstrap(d)} (mean [{INTERVAL}]): "
            f"{verdict(d)}."
        )
    return f"{text} {CAVEAT[0].upper()}{CAVEAT[1:]}."


def figure(raw: Mapping[str, Any]) -> Figure:
    """Three panels, the runs on the same axes: held-out accuracy against steps, held-out
    accuracy against total rollouts (presampling included: PVPO's curve starts at its
    presampling cost), and the training reward against steps."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12.6, 3.6))
    by_step, by_rollouts, reward = fig.subplots(1, 3)
    for name, run in raw["runs"].items():
        label = RUNS[name][0]
        steps, rollouts, _, accuracy = zip(*run["curve"], strict=True)
        by_step.plot(steps, accuracy, marker="o", label=label)
        by_rollouts.plot(rollouts, accuracy, marker="o", label=label)
        if run["reward"]:
            reward.plot(*zip(*run["reward"], strict=True), label=label, alpha=0.8)
    prompts = raw["settings"]["eval_prompts"]
    by_step.set(xlabel="step", ylabel=f"held-out accuracy ({prompts} prompts, greedy)",
                title=f"{raw['task']}: held-out accuracy")  # fmt: skip
    by_rollouts.set(xlabel="rollouts (cumulative, presampling included)",
                    ylabel="held-out accuracy", title="against total rollouts")  # fmt: skip
    reward.set(xlabel="step", ylabel="mean reward", title="training rollouts")
    for ax in (by_step, by_rollouts, reward):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"anchor-rl quickstart, {CAVEAT}", fontsize=9)
    fig.tight_layout()
    return fig


def plot(raw: Mapping[str, Any], path: Path) -> Path:
    """:func:`figure` saved as the PNG ``path``."""
    path = Path(path)
    figure(raw).savefig(path, dpi=110)
    return path


def side_by_side(raw: Mapping[str, Any]) -> tuple[list[str], list[list[str]]]:
    """The runs as columns: accuracy before and after, gain, rollouts, seconds."""
    from anchor_rl.bench.summary import format_bootstrap

    names = [n for n in RUNS if n in raw["runs"]]
    runs = [raw["runs"][n] for n in names]

    def row(label: str, cell) -> list[str]:
        return [label, *(cell(r) for r in runs)]

    rows = [
        row("held-out accuracy before training", lambda r: f"{r['before']:.3f}"),
        row("held-out accuracy after training", lambda r: f"{r['after']:.3f}"),
        row(f"gain over the reference [{INTERVAL}]", lambda r: format_bootstrap(r.get("gain"))),
    ]
    if all("train_after" in r for r in runs):
        rows.append(row("training-prompt accuracy before → after",
                        lambda r: f"{r['train_before']:.3f} → {r['train_after']:.3f}"))  # fmt: skip
    rows += [
        row("training steps", lambda r: str(r["steps"])),
        row("rollouts: training", lambda r: f"{r['rollouts_policy']:.0f}"),
        row("rollouts: presampling", lambda r: f"{r['rollouts_presample']:.0f}"),
        row("rollouts: total", lambda r: f"{r['rollouts_total']:.0f}"),
        row("wall time: training and evaluation", lambda r: f"{r['seconds']:.0f} s"),
    ]
    return ["", *(RUNS[n][0] for n in names)], rows


def host_line(raw: Mapping[str, Any]) -> str:
    """The machine and the SFT reference's stop, the two things that move the figures."""
    host = raw["host"]
    counts = host.get("torch_threads") or {}
    shown = ", ".join(f"{p} {n}" for p, n in counts.items()) or "not recorded"
    text = (
        f"CPU {host['cpu']} ({host['cores']} cores), torch threads {shown} "
        f"(setting `{host['threads_setting']}`"
        + (f", OMP_NUM_THREADS={host['OMP_NUM_THREADS']}" if host.get("OMP_NUM_THREADS") else "")
        + f"), torch {host['torch']}; seed {raw['seed']}"
    )
    sft = raw.get("sft")
    if sft and {"kept_step", "trained_steps", "max_steps", "evaluations"} <= set(sft):
        text += (
            f"; SFT reference stopped at step {sft['trained_steps']:,} of at most "
            f"{sft['max_steps']:,} after {sft['evaluations']} validation evaluations, "
            f"kept step {sft['kept_step']:,}"
        )
    return text + "."


def report_blocks(raw: Mapping[str, Any], out: Path, name: str) -> list[tuple[str, Any]]:
    """``anchor-rl report``'s section for one quickstart: the headline, the runs side by side,
    the machine, and the plot (written to ``out/quickstart_NAME.png``)."""
    png = plot(raw, Path(out) / f"quickstart_{name}.png")
    settings = raw["settings"]
    return [
        ("h3", f"Quickstart `{name}` (task `{raw['task']}`, `{raw['model']}`)"),
        ("p", headline(raw)),
        ("table", side_by_side(raw)),
        (
            "p",
            f"`{raw['command']}`: {settings['steps']} steps of {settings['prompts_per_step']} "
            f"prompts × N = {settings['n']} on {settings['train_prompts']} training prompts "
            f"(PVPO presamples M = {settings['m']} per prompt). " + host_line(raw),
        ),
        ("img", (png.name, "quickstart: held-out accuracy against steps and total rollouts")),
    ]
