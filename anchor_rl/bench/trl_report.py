"""The ``trl`` suite's summary: per-run figures, their mean and 95% t-interval over seeds,
the paired TRL / anchor-rl ratios, ``trl_compare.json``, ``trl_compare.md`` (with every
setting mapped and everything that differs) and ``reward_vs_step.png``."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from anchor_rl.bench.stats import figure_cell, t_interval
from anchor_rl.bench.trl_config import grpo_config_kwargs
from anchor_rl.trainer.config import TrainConfig, build_config

RESULT_FILE = "result.json"
RUN_KEYS = (
    "config", "steps", "wall_s", "process_s", "memory", "eval", "allocator", "trl_options"
)  # fmt: skip
"""What the summary keeps of each run's ``result.json`` (``process_s``: the run's whole
process, start to exit, as the suite timed it; ``allocator``: how its glibc allocator was
set, ``trl_compare.allocator_settings``; ``trl_options``: the ``GRPOConfig`` fields TRL's run
added to the mapping; a stored result may lack any of the three)."""
FRAMEWORKS = ("anchor-rl", "trl")


DIFFERENCES: tuple[tuple[str, str, str, str], ...] = (
    (
        "sampler",
        "own loop with a static KV cache (`decode=auto`: eager on the CPU, where finished "
        "rows leave the batch; on a GPU each step a CUDA graph replay, finished rows kept)",
        "`model.generate`; finished rows are padded until the longest ends",
        "each library's generation path; same temperature, top-p, budget and stop tokens",
    ),
    (
        "random stream",
        "per-request uniforms: splitmix64 of the request's seed and the token's index",
        "`set_seed(seed)` (global RNG)",
        "the same seed draws different samples, so the runs agree in distribution, not token by token",
    ),
    (
        "scoring forward",
        "on the CPU padding-free, each prompt once for the group that shares it; on a GPU "
        "padded unless a pass is large and much of it padding "
        "(`optim.padding_free=auto`, `optim.shared_prefix=auto`)",
        "a padded batch (prompt and completion tensors): each prompt once per completion",
        "each library's default layout; the same log-probs up to float rounding (on the CPU "
        "the prompt's share of the forward and backward pass is paid once per group by "
        "anchor-rl)",
    ),
    (
        "old log-probs",
        "the loss pass's own log-probs, detached (the single pass, `optim.rescore=auto`)",
        "the loss pass's own log-probs, detached (one update per generation)",
        "the same arithmetic (ratio 1); `optim.rescore=always` would add anchor-rl's separate "
        "no-grad pass, one forward per step",
    ),
    (
        "precision",
        "float32; with `optim.autocast=bf16` and `rollout.engine_args.precision=bf16`, scoring "
        "and update under `torch.autocast` to bfloat16 and sampling from a bfloat16 copy of "
        "the weights",
        "float32; with `bf16=True`, accelerate's `torch.autocast` around the model's forward, "
        "generation included",
        "the same bfloat16 matmuls with float32 master weights; anchor-rl's sampler reads "
        "bfloat16 weights where autocast casts the float32 ones at every op",
    ),
    (
        "allocator",
        "glibc's mmap and trim thresholds raised when the run starts (`anchor_rl.allocator`; "
        "`ANCHOR_RL_MALLOC=default` turns it off)",
        "glibc's defaults",
        "each library's process as a user gets it; freed memory kept for the next step saves "
        "anchor-rl the page faults of re-allocating it (a control: the `MALLOC_*_THRESHOLD_` "
        "variables set for both, docs/results.md)",
    ),
    (
        "std epsilon",
        "1e-6",
        "1e-4 (hard-coded)",
        "TRL has no setting for it; for 0/1 rewards at n = 8 a non-zero group std is >= 0.35, so "
        "advantages differ by < 3e-4 relative",
    ),
    (
        "step time",
        "`time/step` (rollout, rewards, log-probs, update, metric line)",
        "wall time between consecutive `on_step_end` callbacks",
        "both cover generation, scoring, reference log-probs and the update; neither includes "
        "model loading or the final save",
    ),
    (
        "process memory",
        "imports torch, transformers",
        "also imports trl, accelerate, datasets, pandas",
        "peak RSS counts everything the process loaded; the RSS before training is shown too",
    ),
)
"""What cannot be made equal: (setting, anchor-rl, TRL, why)."""


FIGURES: dict[str, str] = {
    "s_per_step": "seconds per step (mean over steps)",
    "s_per_step_warm": "seconds per step after the first (mean; the first warms caches up)",
    "tokens_per_s": "generated tokens per second of training",
    "tokens_per_step": "generated tokens per step",
    "rss_peak_mb": "peak resident memory of the process (MiB)",
    "rss_before_mb": "resident memory before the first step (MiB)",
    "cuda_peak_mb": "peak allocated GPU memory during training (MiB)",
    "eval_start": "held-out accuracy of the initial model",
    "eval_final": "held-out accuracy after the last step",
    "reward_last": "training reward, mean over the last fifth of the steps",
}


def figure_digits(key: str) -> int:
    """Decimals a figure is shown with: accuracies and rewards 3, seconds 2, counts 0."""
    return 3 if key.startswith(("eval", "reward")) else 2 if key.startswith("s_per_step") else 0


RATIOS = (
    "s_per_step",
    "s_per_step_warm",
    "tokens_per_s",
    "tokens_per_step",
    "rss_peak_mb",
    "cuda_peak_mb",
)


def run_figures(result: dict[str, Any]) -> dict[str, float]:
    """The ``FIGURES`` of one run's ``result.json`` (those it has)."""
    steps = result["steps"]
    if not steps:
        raise ValueError("the run has no step")
    seconds = sum(s["seconds"] for s in steps)
    tokens = sum(s["tokens"] for s in steps)
    tail = steps[-max(1, len(steps) // 5) :]
    memory = result["memory"]
    out = {
        "s_per_step": seconds / len(steps),
        "tokens_per_s": tokens / seconds,
        "tokens_per_step": tokens / len(steps),
        "rss_peak_mb": memory["rss_peak_mb"],
        "rss_before_mb": memory["rss_before_mb"],
        "reward_last": sum(s["reward"] for s in tail) / len(tail),
    }
    if len(steps) > 1:
        out["s_per_step_warm"] = sum(s["seconds"] for s in steps[1:]) / (len(steps) - 1)
    if memory.get("cuda_peak_mb") is not None:
        out["cuda_peak_mb"] = memory["cuda_peak_mb"]
    if "eval" in result:
        out["eval_start"] = result["eval"]["start"]["eval/accuracy"]
        out["eval_final"] = result["eval"]["final"]["eval/accuracy"]
    return out


def summarise(
    results: dict[str, list[dict[str, Any]]],
    figures: Callable[[dict[str, Any]], dict[str, float]] = run_figures,
    keys: Iterable[str] = FIGURES,
) -> dict[str, dict[str, dict[str, Any]]]:
    """Per framework and figure: mean, 95% t half-width, n and the per-seed values of the
    ``keys`` that ``figures`` gives of each run's result."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for framework, runs in results.items():
        rows = [figures(r) for r in runs]
        out[framework] = {}
        for key in keys:
            values = [row[key] for row in rows if key in row]
            if values:
                out[framework][key] = _interval(values)
    return out


def _interval(values: list[float]) -> dict[str, Any]:
    iv = t_interval(values)
    return {"mean": iv.mean, "half_width": iv.half_width, "n": iv.n, "values": values}


def ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per seed (the two runs of a seed ran back to back), TRL / anchor-rl for the cost
    figures and TRL - anchor-rl for the final accuracy (``eval_final_diff``); mean, 95%
    t half-width, n and the per-seed values, like ``summarise``."""
    ours, theirs = summary["anchor-rl"], summary["trl"]
    paired: dict[str, list[float]] = {}
    for key in RATIOS:
        if key in ours and key in theirs:
            pairs = zip(theirs[key]["values"], ours[key]["values"], strict=True)
            paired[key] = [t / o for t, o in pairs]
    if "eval_final" in ours and "eval_final" in theirs:
        pairs = zip(theirs["eval_final"]["values"], ours["eval_final"]["values"], strict=True)
        paired["eval_final_diff"] = [t - o for t, o in pairs]
    out = {}
    for key, values in paired.items():
        out[key] = _interval(values)
    return out


def write_summary(
    out: Path,
    cfg: TrainConfig,
    results: dict[str, list[dict[str, Any]]],
    command: str,
    planned: Sequence[int],
    note: str = "",
    options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Summarise the seeds both trainers finished (of the ``planned`` ones); ``options``:
    the ``GRPOConfig`` fields TRL's runs added to the mapping (``trl.FIELD=VALUE``)."""
    results, alone = _paired(results)
    summary = summarise(results)
    mapped = grpo_config_kwargs(cfg, "", options)
    host = results["trl"][0]["host"]
    payload = {
        "suite": "trl",
        "command": command,
        "trl_version": results["trl"][0]["version"],
        "host": host,
        "seeds": [r["config"]["seed"] for r in results["anchor-rl"]],
        "seeds_planned": list(planned),
        "unpaired": alone,
        "note": note,
        "settings": _settings(cfg),
        "trl_options": dict(options or {}),
        "grpo_config": {k: v for k, v in mapped.items() if k != "output_dir"},
        "differences": [list(d) for d in DIFFERENCES],
        "figures": FIGURES,
        "summary": summary,
        "ratios": ratios(summary),
        "runs": {
            f: [{k: r[k] for k in RUN_KEYS if k in r} for r in rs] for f, rs in results.items()
        },
    }
    json_path, md_path = out / "trl_compare.json", out / "trl_compare.md"
    json_path.write_text(json.dumps(payload, indent=2))
    md_path.write_text(markdown(payload))
    plot = out / "reward_vs_step.png"
    plot_rewards(payload["runs"], plot)
    return {"summary_json": json_path, "summary_md": md_path, "plots": [plot]}


def rewrite_summary(
    out: Path, command: str, planned: Sequence[int] | None = None, note: str = ""
) -> dict[str, Any]:
    """Summarise the finished runs in ``out`` again (``trl_compare.json`` / ``.md``, the
    plot), e.g. of a comparison stopped before its last seed: seeds that only one trainer
    finished are left out, and the summary names them. ``command`` is the one the runs came
    from; ``planned`` its seeds (default: those with a finished run); ``note`` a sentence
    for the summary (e.g. how the runs' code differs from the current one).

    Returns ``{"summary_json", "summary_md", "plots"}`` paths, like the suite."""
    results: dict[str, list[dict[str, Any]]] = {f: [] for f in FRAMEWORKS}
    for framework in FRAMEWORKS:
        for path in sorted((out / framework).glob(f"seed*/{RESULT_FILE}")):
            results[framework].append(json.loads(path.read_text()))
    paired, _ = _paired(results)
    if not paired["trl"]:
        raise ValueError(f"{out} holds no seed that both trainers finished")
    if planned is None:
        planned = {r["config"]["seed"] for runs in results.values() for r in runs}
    cfg = build_config(paired["anchor-rl"][0]["config"])
    options = paired["trl"][0].get("trl_options", {})
    return write_summary(out, cfg, results, command, sorted(planned), note, options)


def _paired(
    results: dict[str, list[dict[str, Any]]],
) -> tuple[dict[str, list[dict[str, Any]]], list[str]]:
    """The runs of the seeds both trainers finished (each framework's in seed order), and
    the others as ``framework seed N``."""
    by_seed = {f: {r["config"]["seed"]: r for r in runs} for f, runs in results.items()}
    both = sorted(set.intersection(*(set(runs) for runs in by_seed.values())))
    alone = [
        f"{f} seed {seed}"
        for f, runs in by_seed.items()
        for seed in sorted(runs)
        if seed not in both
    ]
    return {f: [runs[seed] for seed in both] for f, runs in by_seed.items()}, alone


def _settings(cfg: TrainConfig) -> dict[str, Any]:
    r, o = cfg.rollout, cfg.optim
    return {
        "preset": cfg.preset,
        "task": cfg.task,
        "model": cfg.model,
        "steps": cfg.steps,
        "prompts_per_step": r.prompts_per_step,
        "group_size": r.n,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "max_new_tokens": r.max_new_tokens,
        "lr": o.lr,
        "epochs": o.epochs,
        "mini_batches": o.mini_batches,
        "kl_coef": cfg.kl.coef,
        "clip": [cfg.loss.clip_low, cfg.loss.clip_high],
        "loss_agg": cfg.loss.agg,
        "precision": "bf16" if cfg.optim.autocast == "bf16" else "fp32",
        "anchor_rl_decode": cfg.rollout.engine_args.get("decode", "auto"),
        "eval_prompts": cfg.eval.prompts,
        "eval_temperature": cfg.eval.temperature,
    }


def ratio_cells(ratio: dict[str, dict[str, Any]], key: str, times: str = "x") -> tuple[str, str]:
    """The paired TRL / anchor-rl cell of figure ``key`` (mean ± half-width of the per-seed
    ratios, ``times`` after it; for the final accuracy the difference) and the median of the
    per-seed values (with three seeds, the middle one); empty strings where ``key`` has none."""
    if key in ratio:
        median = statistics.median(ratio[key]["values"])
        return figure_cell(ratio[key], 2) + times, f"{median:.2f}{times}"
    if key == "eval_final" and "eval_final_diff" in ratio:
        diff = ratio["eval_final_diff"]
        return figure_cell(diff, 3) + " (difference)", f"{statistics.median(diff['values']):+.3f}"
    return "", ""


def _decode_note(decode: str) -> str:
    """What the summary says of anchor-rl's decoder when it is not the default one (the
    differences table describes ``decode=auto``)."""
    if decode == "auto":
        return ""
    return f" anchor-rl samples with `rollout.engine_args.decode={decode}`."


def _options_note(options: dict[str, Any]) -> str:
    """What the summary says of TRL's own speed settings, where its runs had some."""
    if not options:
        return ""
    return " TRL also ran with " + ", ".join(f"`{k}={v!r}`" for k, v in options.items()) + "."


def partial_note(payload: dict[str, Any]) -> list[str]:
    """The payload's note, and a paragraph when fewer seeds were summarised than planned."""
    planned = payload.get("seeds_planned", payload["seeds"])
    note = [payload["note"], ""] if payload.get("note") else []
    if list(planned) == list(payload["seeds"]):
        return note
    left = ", ".join(payload.get("unpaired", [])) or "none"
    return [
        *note,
        f"**Partial**: {len(payload['seeds'])} of the {len(planned)} planned seeds "
        f"({', '.join(map(str, planned))}) finished with both trainers; finished runs left "
        f"out for want of their pair: {left}.",
        "",
    ]


def markdown(payload: dict[str, Any]) -> str:
    """The comparison as markdown: figures with ratios, settings, the mapping, the differences."""
    summary, ratio, host = payload["summary"], payload["ratios"], payload["host"]
    versions = ", ".join(f"{k} {v}" for k, v in host["versions"].items() if v and k != "trl")
    s = payload["settings"]
    lines = [
        "# Suite `trl`: anchor-rl `grpo` beside TRL `GRPOTrainer`",
        "",
        f"TRL {payload['trl_version']} ({versions}); device {host['device']} "
        f"({host['device_name']}, {host['torch_threads']} torch threads); seeds "
        f"{', '.join(map(str, payload['seeds']))}, each trainer in a fresh process, in alternation.",
        "",
        f"Same for both: task `{s['task']}`, model `{s['model']}`, {s['steps']} steps of "
        f"{s['prompts_per_step']} prompts x {s['group_size']} completions (the same prompts in the "
        f"same order), temperature {s['temperature']}, top-p {s['top_p']}, at most "
        f"{s['max_new_tokens']} new tokens, lr {s['lr']:g}, KL beta {s['kl_coef']:g} (k3 in the "
        f"loss), clip {s['clip'][0]}/{s['clip'][1]}, loss `{s['loss_agg']}`, {s['epochs']} "
        f"epoch(s) x {s['mini_batches']} mini-batch(es), {s.get('precision', 'fp32')}. "
        "Held-out accuracy: "
        f"{s['eval_prompts']} test prompts, temperature {s['eval_temperature']}, the same "
        "`evaluate_model` call for both final models."
        + _decode_note(s.get("anchor_rl_decode", "auto"))
        + _options_note(payload.get("trl_options", {})),
        "",
        *partial_note(payload),
        "Mean ± half-width of the 95% Student-t interval over seeds; the last two columns "
        "pair the two runs of each seed (they ran back to back): the mean of the per-seed "
        "ratios and their median. Wall-clock figures were taken on a shared machine; the "
        "ratio is the comparable number.",
        "",
        "| figure | anchor-rl | TRL | TRL / anchor-rl | median of seeds |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for key, label in FIGURES.items():
        ours, theirs = summary["anchor-rl"].get(key), summary["trl"].get(key)
        if ours is None and theirs is None:
            continue
        digits = figure_digits(key)
        rel, median = ratio_cells(ratio, key)
        lines.append(
            f"| {label} | {figure_cell(ours, digits)} | {figure_cell(theirs, digits)} | {rel} | {median} |"
        )
    lines += [
        "",
        "## Settings mapped to `GRPOConfig`",
        "",
        ", ".join(f"`{k}={v!r}`" for k, v in payload["grpo_config"].items()),
        "",
        "## What differs, and why",
        "",
        "| setting | anchor-rl | TRL | why |",
        "| --- | --- | --- | --- |",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in payload["differences"]),
        "",
        f"Command: `{payload['command']}`",
        "",
    ]
    return "\n".join(lines)


def plot_rewards(runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """Training reward against step, mean over seeds, one line per framework."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 4.0), layout="constrained")
    ax = fig.subplots()
    for framework, rs in runs.items():
        n = min(len(r["steps"]) for r in rs)
        xs = list(range(1, n + 1))
        ys = [sum(r["steps"][i]["reward"] for r in rs) / len(rs) for i in range(n)]
        ax.plot(xs, ys, marker="o", markersize=3, label=f"{framework} (n={len(rs)})")
    ax.set_xlabel("step")
    ax.set_ylabel("training reward (mean over the step's completions)")
    ax.set_title("anchor-rl grpo vs TRL GRPOTrainer")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
