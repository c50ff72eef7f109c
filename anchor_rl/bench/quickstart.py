"""``anchor-rl quickstart``: PVPO end to end in a few minutes on a CPU, with a report.

    1 SFT reference     ``sft:tiny`` on the task, trained once and cached ($ANCHOR_RL_CACHE)
    2 presample, filter M reference rollouts per training prompt into the anchor store
                        (cached), group sampling with the oracle teacher
    3 PVPO training     the ``pvpo_paper`` preset, held-out evaluation before, during and after
    4 GRPO comparison   the ``grpo`` preset at the same settings in ``OUT/grpo``
    5 report            ``OUT/quickstart.json`` (raw results, what ``anchor-rl report OUT``
                        reads), ``OUT/report.md`` and ``OUT/report.png``

The run itself is an ordinary run directory (``anchor-rl train --resume OUT`` continues it).
Settings: the ``pvpo_paper`` preset (:data:`PRESET`), then :data:`SETTINGS` (sized to finish within 10 minutes on
2 CPU cores from an empty cache; see docs/quickstart.md), then the task's extras, then
``--steps`` / ``--time-limit`` and ``key=value`` overrides.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from anchor_rl import threads
from anchor_rl.bench import quickstart_results as results
from anchor_rl.trainer.config import TrainConfig, load_config

PRESET = "pvpo_paper"
"""The quickstart's preset: the paper's setting, the ``pvpo`` preset when the committed
result (docs/results/quickstart, :data:`MEASURED_S`) was measured. Re-measuring it with
today's ``pvpo`` preset (lazy, reused, sequential, pooled anchors) is pending."""
SETTINGS: tuple[str, ...] = (
    "model=sft:tiny",
    "train_prompts=256",
    "steps=60",
    "rollout.prompts_per_step=8",
    "rollout.n=4",
    "pvpo.m=8",
    "eval.every=20",
    "eval.prompts=1000",
    "eval.train_prompts=256",
    "checkpoint.every=20",
)
"""The quickstart run on top of :data:`PRESET`."""
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "multihop": ("task_args.reward=pvpo", "pvpo.m=5", "rollout.max_new_tokens=192"),
}
"""Per-task extras: on multihop the paper's reward manager, its QA setting M = 5, and room for
the longest 4-hop trace (176 tokens with the tool results)."""
REPORT_MD, REPORT_PNG = "report.md", "report.png"
GRPO_DIR = "grpo"
"""The GRPO comparison run's directory inside the quickstart's."""
MEASURED_S = {"sft": 316, "pvpo": 33, "grpo": 24}
"""Seconds each phase took with the default settings on arithmetic, on the 2-core machine of
docs/quickstart.md (SFT reference; PVPO presampling and training; the GRPO comparison)."""


def quickstart_config(
    task: str,
    steps: int | None = None,
    time_limit: float | None = None,
    overrides: Sequence[str] = (),
) -> TrainConfig:
    """The quickstart's training config for ``task``; ConfigError naming a bad field or task."""
    extra = [f"steps={steps}"] if steps is not None else []
    if time_limit is not None:
        extra.append(f"time_limit={time_limit}")
    return load_config(
        PRESET, [f"task={task}", *SETTINGS, *TASK_SETTINGS.get(task, ()), *extra, *overrides]
    )


def grpo_config(cfg: TrainConfig) -> TrainConfig:
    """The comparison run: the ``grpo`` preset with the quickstart run's task, model,
    prompts, steps, N, evaluation and seed, and PVPO's KL coefficient, so the advantage
    (group mean and std instead of the static anchor) and group sampling are the only
    differences."""
    same = {
        "task": cfg.task, "task_args": cfg.task_args, "model": cfg.model,
        "train_prompts": cfg.train_prompts, "steps": cfg.steps, "time_limit": cfg.time_limit,
        "seed": cfg.seed, "device": cfg.device, "threads": cfg.threads,
        "rollout": cfg.rollout.model_dump(),
        "eval": cfg.eval.model_dump(), "optim": cfg.optim.model_dump(),
        "checkpoint": cfg.checkpoint.model_dump(), "log": cfg.log.model_dump(),
        "kl": {"coef": cfg.kl.coef},
    }  # fmt: skip

    def leaves(table: Mapping[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in table.items():
            if isinstance(value, Mapping):
                out += leaves(value, f"{prefix}{key}.")
            elif value is not None:
                out.append(f"{prefix}{key}={json.dumps(value)}")
        return out

    return load_config("grpo", leaves(same))


def expected_time(cfg: TrainConfig, compare: bool) -> str:
    """What to expect before the quickstart starts: the measured time of the default run on
    2 cores (SFT included when its reference is not cached yet), or that none was measured."""
    from anchor_rl.models.sft import default_config, is_complete, sft_dir

    if cfg != quickstart_config(cfg.task) or cfg.task != "arithmetic":
        return "expected time: not measured for these settings"
    sft = default_config(cfg.task, cfg.model.partition(":")[2])
    cached = is_complete(sft_dir(sft), sft)
    phases = {"sft": 0 if cached else MEASURED_S["sft"], "pvpo": MEASURED_S["pvpo"]}
    phases["grpo"] = MEASURED_S["grpo"] if compare else 0
    total = sum(phases.values())
    sft_note = (
        "reference cached" if cached else f"{phases['sft'] // 60} min of it the SFT reference"
    )
    return (
        f"expected time: about {total / 60:.0f} min on 2 CPU cores ({sft_note}; measured on "
        "the machine of docs/quickstart.md)"
    )


def run_quickstart(
    cfg: TrainConfig, out: Path, compare: bool = True, command: str = "anchor-rl quickstart"
) -> dict[str, Any]:
    """SFT reference, presampling and group sampling, PVPO training, (with ``compare``) GRPO
    at the same settings in ``OUT/grpo``, then the raw results (``OUT/quickstart.json``,
    :mod:`anchor_rl.bench.quickstart_results`; ``command`` is recorded there) and the report;
    returns the report's facts (also in ``OUT/report.md``), ``raw`` and the files' paths."""
    from rich.console import Console

    from anchor_rl.rollout.spec import sft_model_dir
    from anchor_rl.trainer.loop import train
    from anchor_rl.trainer.run import load_task, start_run

    console = Console()
    load_task(cfg)  # a bad task fails before any work
    gcfg = grpo_config(cfg) if compare else None
    console.print(expected_time(cfg, compare))
    out = Path(out)
    phases = 5 if compare else 4
    started = time.perf_counter()
    threads.configure(cfg.threads)  # the SFT reference's steps too
    sft_dir = None
    if cfg.model.startswith("sft:"):
        console.rule(f"[bold]1/{phases} SFT reference")
        sft_dir = sft_model_dir(cfg.model, cfg.task, cfg.task_args, progress=cfg.log.progress)
    sft_s = time.perf_counter() - started
    console.rule(f"[bold]2/{phases} presample the reference, group sampling")
    run = start_run(cfg, out)
    setup_s = time.perf_counter() - started - sft_s
    console.rule(f"[bold]3/{phases} PVPO training")
    train(run)
    if gcfg is not None:
        console.rule(f"[bold]4/{phases} GRPO at the same settings (the comparison)")
        train(start_run(gcfg, out / GRPO_DIR))
    total_s = time.perf_counter() - started
    console.rule(f"[bold]{phases}/{phases} report")
    seconds = {"sft": sft_s, "setup": setup_s, "total": total_s}
    raw = results.collect(out, command, seconds, sft_dir)
    raw_path = results.write_raw(out, raw)
    facts = report_facts(out, cfg, sft_s, setup_s, total_s)
    md, png = write_report(out, facts, raw)
    return {**facts, "raw": raw, "raw_json": raw_path, "report_md": md, "report_png": png}


def report_facts(
    run_dir: Path, cfg: TrainConfig, sft_s: float, setup_s: float, total_s: float
) -> dict[str, Any]:
    """The numbers the report shows, read from the run directory."""
    from anchor_rl.trainer.logging import read_metrics

    records = read_metrics(run_dir)
    evals = [r for r in records if "eval/accuracy" in r]
    if not evals:
        raise ValueError(f"{run_dir} has no held-out evaluation; quickstart needs eval.every > 0")
    last = records[-1]
    pvpo = json.loads((Path(run_dir) / "pvpo.json").read_text())
    filter_file = Path(run_dir) / "pvpo_filter.json"
    return {
        "task": cfg.task,
        "model": cfg.model,
        "run_dir": str(run_dir),
        "steps": last["step"],
        "steps_asked": cfg.steps,
        "accuracy_before": evals[0]["eval/accuracy"],
        "accuracy_after": evals[-1]["eval/accuracy"],
        "eval_prompts": cfg.eval.prompts,
        "rollouts_policy": last["rollouts/cumulative"],
        "rollouts_presample": last["rollouts/presample"],
        "rollouts_total": last["rollouts/total"],
        "training_prompts": pvpo["training_prompts"],
        "prompts": pvpo["prompts"],
        "reference_accuracy": pvpo["reference_accuracy"],
        "filter": json.loads(filter_file.read_text()) if filter_file.is_file() else None,
        "sft_s": sft_s,
        "setup_s": setup_s,
        "train_s": last["time/elapsed"],
        "total_s": total_s,
        "train_curve": [
            (r["step"], r["eval/train_accuracy"]) for r in evals if "eval/train_accuracy" in r
        ],
    }


def write_report(out: Path, facts: Mapping[str, Any], raw: Mapping[str, Any]) -> tuple[Path, Path]:
    """``report.md`` and ``report.png`` (:func:`anchor_rl.bench.quickstart_results.plot`:
    every run's held-out accuracy against steps and total rollouts, and training reward)."""
    out = Path(out)
    png = results.plot(raw, out / REPORT_PNG)
    md = out / REPORT_MD
    md.write_text(_markdown(facts, raw))
    return md, png


def _comparison_lines(raw: Mapping[str, Any]) -> list[str]:
    header, rows = results.side_by_side(raw)
    return [
        "## PVPO beside GRPO",
        "",
        results.headline(raw),
        "",
        "Both runs start from the same reference and train the same steps on the same prompts "
        "with the same N, learning rate and KL coefficient; GRPO's run is in "
        f"`{GRPO_DIR}/`. " + results.host_line(raw),
        "",
        "| " + " | ".join(header) + " |",
        "| --- |" + " ---: |" * (len(header) - 1),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _markdown(f: Mapping[str, Any], raw: Mapping[str, Any]) -> str:
    stopped = "" if f["steps"] == f["steps_asked"] else f" (time limit; {f['steps_asked']} asked)"
    lines = [
        f"# anchor-rl quickstart: PVPO on `{f['task']}`",
        "",
        f"Policy and reference `{f['model']}`; run directory `{f['run_dir']}` "
        f"(`anchor-rl train --resume {f['run_dir']} steps=N` continues it).",
        "",
        *(_comparison_lines(raw) if "pvpo_minus_grpo" in raw else []),
        "## PVPO's run",
        "",
        "| | |",
        "| --- | ---: |",
        f"| held-out accuracy before training | {f['accuracy_before']:.3f} |",
        f"| held-out accuracy after training | {f['accuracy_after']:.3f} |",
        f"| held-out prompts (greedy) | {f['eval_prompts']} |",
        *_train_rows(f),
        f"| training steps | {f['steps']}{stopped} |",
        f"| training prompts after group sampling | {f['training_prompts']} of {f['prompts']} |",
        f"| reference accuracy on the training prompts (presampled) | {f['reference_accuracy']:.3f} |",
        f"| rollouts: training | {f['rollouts_policy']:.0f} |",
        f"| rollouts: presampling | {f['rollouts_presample']:.0f} |",
        f"| rollouts: total | {f['rollouts_total']:.0f} |",
        f"| wall time: SFT reference (0 when cached) | {f['sft_s']:.0f} s |",
        f"| wall time: presampling and group sampling | {f['setup_s']:.0f} s |",
        f"| wall time: training and evaluation | {f['train_s']:.0f} s |",
        f"| wall time: total | {f['total_s']:.0f} s |",
        "",
        f"Raw results: `{results.RAW_FILE}` (`anchor-rl report {f['run_dir']}` reads them).",
        "",
        f"![held-out accuracy against steps and rollouts, training reward]({REPORT_PNG})",
        "",
    ]
    if f["filter"] is not None:
        frac = f["filter"]["fractions"]
        paper = f["filter"]["paper"]["accuracy_distribution"]
        lines += [
            "## Group sampling",
            "",
            "| reference accuracy | this run | " + " | ".join(f"paper: {p}" for p in paper) + " |",
            "| --- | ---: | " + " | ".join("---:" for _ in paper) + " |",
        ]
        for label, key in (("0", "acc_zero"), ("0 < acc < 1", "acc_mixed"), ("1", "acc_one")):
            cells = " | ".join(f"{d[key]:.1%}" for d in paper.values())
            lines.append(f"| {label} | {frac[key]:.1%} | {cells} |")
        lines += [
            "",
            f"Kept {frac['training']:.1%} of the prompts ({frac['with_teacher']:.1%} with a teacher "
            f"trajectory); filtered out {frac['dropped']:.1%} (paper: "
            f"{f['filter']['paper']['filtered']}).",
            "",
        ]
    return "\n".join(lines)


def _train_rows(f: Mapping[str, Any]) -> list[str]:
    if not f["train_curve"]:
        return []
    (_, before), (_, after) = f["train_curve"][0], f["train_curve"][-1]
    return [
        f"| training-prompt accuracy before training (greedy) | {before:.3f} |",
        f"| training-prompt accuracy after training | {after:.3f} |",
    ]
