"""Suite ``trl-pvpo``: TRL's ``GRPOTrainer`` beside :class:`PVPOGRPOTrainer`, same N.

One command (``anchor-rl bench trl-pvpo --seeds 0,1,2``) trains, for every seed, TRL's
plain ``GRPOTrainer`` and the plug-in's ``PVPOGRPOTrainer`` from the same initial model on
the same training prompts, with the same ``GRPOConfig`` (the ``grpo`` preset mapped by
``anchor_rl.bench.trl_config.grpo_config_kwargs``: group size N, prompts per step,
learning rate, clipping, KL, loss), so the only difference is the trainer class: PVPO's
advantage ``r - V_sta``, group sampling and teacher rows. Both final models and the
initial one are evaluated on the held-out prompts by the same function
(``anchor_rl.trainer.run.evaluate_model``, which samples through
``anchor_rl.rollout.evaluate``). Rollouts are counted with everything they rest on:
GRPO's are its completions; PVPO's are its completions, the reference rollouts its
anchors rest on (``pvpo.m`` per training prompt, rows found in the store included) and the
teacher's samples.

Writes ``OUT/METHOD/seedK/result.json`` per run (a finished run of the same config is
reused), ``OUT/trl_pvpo.json`` and ``OUT/trl_pvpo.md`` (mean and 95% t-interval over
seeds). ``pvpo.*`` overrides set PVPO's knobs (``pvpo.m=4``), the others the runs' config.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from anchor_rl.bench.host import host_info
from anchor_rl.bench.runner import BenchArgs, RunSpec, Suite, command_line, plan
from anchor_rl.bench.stats import figure_cell
from anchor_rl.bench.trl_compare import RewardCounter, initial_policy
from anchor_rl.bench.trl_config import grpo_config_kwargs
from anchor_rl.bench.trl_report import summarise
from anchor_rl.errors import ConfigError
from anchor_rl.integrations.trl.checks import section
from anchor_rl.integrations.trl.data import task_dataset, task_reward_function
from anchor_rl.integrations.trl.pvpo import PVPOGRPOTrainer
from anchor_rl.methods.pvpo_config import PVPOConfig
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.presets import parse_override

SUITE_NAME = "trl-pvpo"
METHODS = ("grpo", "pvpo")
RESULT_FILE = "result.json"

TRL_PVPO_SUITE = Suite(
    name=SUITE_NAME,
    description="TRL GRPOTrainer vs the plug-in's PVPOGRPOTrainer: same GRPOConfig, same N",
    presets=["grpo"],
    seeds=[0, 1, 2],
    base={
        "task": "arithmetic",
        "model": "sft:tiny",
        "train_prompts": 512,
        "steps": 100,
        "rollout": {"prompts_per_step": 8, "n": 8},
        "eval": {"every": 0, "prompts": 200, "train_prompts": 200},
        "checkpoint": {"every": 0},
        "log": {"tensorboard": False, "progress": True},
    },
    profiles={
        "quick": {
            "model": "random:tiny",
            "train_prompts": 8,
            "steps": 1,
            "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 8},
            "eval": {"prompts": 4, "train_prompts": 4},
            "log": {"progress": False},
        }
    },
)
"""The runs' config (the ``grpo`` preset; ``rollout.n`` is N for both trainers)."""
PVPO_DEFAULTS: dict[str, Any] = {}
"""PVPO's knobs beyond ``PVPOConfig``'s defaults (M = 8, oracle teacher)."""
QUICK_PVPO: dict[str, Any] = {"m": 2}
"""PVPO's knobs in the quick profile."""

FIGURES = {
    "eval_start": "held-out accuracy of the initial model",
    "eval_final": "held-out accuracy after training",
    "train_eval_final": "training-prompt accuracy after training",
    "rollouts_policy": "policy completions generated",
    "rollouts_presample": "reference rollouts the anchors rest on",
    "rollouts_teacher": "teacher samples",
    "rollouts_total": "all rollouts",
    "wall_s": "wall seconds of training (presampling included)",
}


def run_trl_pvpo_suite(args: BenchArgs) -> dict[str, Any]:
    """Train both trainers for every seed, evaluate, write ``trl_pvpo.json`` / ``.md``;
    returns ``{"summary_json", "summary_md", "plots"}``."""
    out, seeds, steps, overrides, profile, echo = args.unpack()
    settings = [o for o in overrides if not o.startswith("pvpo.")]
    knobs = dict(QUICK_PVPO if profile == "quick" else PVPO_DEFAULTS)
    for item in (o for o in overrides if o.startswith("pvpo.")):
        key, value = parse_override(item)
        knobs[key.removeprefix("pvpo.")] = value
    pc = section(PVPOConfig, knobs, "pvpo")
    specs = plan(TRL_PVPO_SUITE, out, seeds, steps, settings, profile)
    for spec in specs:
        grpo_config_kwargs(spec.config, "")  # fail before any run
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for k, spec in enumerate(specs):
        start = None
        for method in METHODS:
            run_dir = out / method / f"seed{spec.seed}"
            echo(
                f"[{2 * k + METHODS.index(method) + 1}/{2 * len(specs)}] {method} seed {spec.seed}"
            )
            result = _run_once(method, spec, pc, run_dir, start)
            start = result["eval"]["start"]
            results[method].append(result)
    return _write(out, specs[0].config, pc, results, command_line(
        SUITE_NAME, out, seeds, steps, overrides, profile
    ))  # fmt: skip


def _run_once(
    method: str,
    spec: RunSpec,
    pc: PVPOConfig,
    run_dir: Path,
    start: dict[str, float] | None,
) -> dict[str, Any]:
    """One run (reused when ``run_dir`` holds a finished one of the same config)."""
    config = {"train": spec.config.model_dump(mode="json"), "pvpo": pc.model_dump(mode="json")}
    path = run_dir / RESULT_FILE
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored["config"] == config:
            return stored
    run_dir.mkdir(parents=True, exist_ok=True)
    result = train_one(method, spec.config, pc, run_dir, start)
    result |= {"method": method, "seed": spec.seed, "config": config}
    path.write_text(json.dumps(result, indent=2))
    return result


def train_one(
    method: str,
    cfg: TrainConfig,
    pc: PVPOConfig,
    run_dir: Path,
    start: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Train ``method`` (``grpo``: TRL's GRPOTrainer; ``pvpo``: PVPOGRPOTrainer) per ``cfg``;
    returns held-out metrics before (``start``, computed unless given) and after, the rollout
    counts and the wall time."""
    import trl
    from transformers.trainer_callback import PrinterCallback

    from anchor_rl.models.loading import quiet_transformers
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.trainer.run import evaluate_model, load_task

    if method not in METHODS:
        raise ConfigError(f"method {method!r}: choose one of {', '.join(METHODS)}")
    task = load_task(cfg)
    with quiet_transformers():
        policy, tokenizer = initial_policy(cfg, run_dir)
    if start is None:
        start = evaluate_model(make_engine("hf", policy, tokenizer), task, cfg, 0)
    records = task.records("train")[: cfg.train_prompts]
    kwargs = grpo_config_kwargs(cfg, str(run_dir / "trainer"))
    kwargs |= {"shuffle_dataset": True, "disable_tqdm": not cfg.log.progress}
    args = trl.GRPOConfig(**kwargs)
    dataset = task_dataset(task, tokenizer, records)
    counted = RewardCounter(task_reward_function(task, records))
    started = time.perf_counter()
    with quiet_transformers():  # TRL loads its reference model (beta > 0)
        if method == "grpo":
            trainer = trl.GRPOTrainer(
                model=policy, reward_funcs=counted, args=args, train_dataset=dataset,
                processing_class=tokenizer,
            )  # fmt: skip
        else:
            trainer = PVPOGRPOTrainer(
                model=policy, args=args, train_dataset=dataset, processing_class=tokenizer,
                task=task, task_args=cfg.task_args, records=records, pvpo=pc,
                progress=cfg.log.progress,
            )  # fmt: skip
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    wall = time.perf_counter() - started
    if method == "grpo":
        n = counted.completions
        rollouts = {"policy": n, "presample": 0, "teacher": 0, "total": n}
    else:  # the plug-in's own count, its total included
        rollouts = trainer.rollout_counts()
    model = trainer.accelerator.unwrap_model(trainer.model)
    final = evaluate_model(make_engine("hf", model, tokenizer), task, cfg, cfg.steps)
    return {
        "trl_version": trl.__version__,
        "eval": {"start": start, "final": final},
        "rollouts": rollouts,
        "wall_s": wall,
        "steps": int(trainer.state.global_step),
        "log_history": trainer.state.log_history,
    }


def figures(result: dict[str, Any]) -> dict[str, float]:
    """The :data:`FIGURES` of one run's result."""
    start, final, r = result["eval"]["start"], result["eval"]["final"], result["rollouts"]
    out = {
        "eval_start": start["eval/accuracy"],
        "eval_final": final["eval/accuracy"],
        "rollouts_policy": float(r["policy"]),
        "rollouts_presample": float(r["presample"]),
        "rollouts_teacher": float(r["teacher"]),
        "rollouts_total": float(r["total"]),
        "wall_s": result["wall_s"],
    }
    if "eval/train_accuracy" in final:
        out["train_eval_final"] = final["eval/train_accuracy"]
    return out


def _write(
    out: Path,
    cfg: TrainConfig,
    pc: PVPOConfig,
    results: dict[str, list[dict[str, Any]]],
    command: str,
) -> dict[str, Any]:
    payload = {
        "suite": SUITE_NAME,
        "command": command,
        "trl_version": results["grpo"][0]["trl_version"],
        "host": host_info(cfg.device),
        "seeds": [r["seed"] for r in results["grpo"]],
        "grpo_config": {k: v for k, v in grpo_config_kwargs(cfg, "").items() if k != "output_dir"},
        "pvpo": pc.model_dump(mode="json"),
        "figures": FIGURES,
        "summary": summarise(results, figures, FIGURES),
        "runs": {
            m: [{k: r[k] for k in ("seed", "eval", "rollouts", "wall_s", "steps")} for r in rs]
            for m, rs in results.items()
        },  # fmt: skip
    }
    json_path, md_path = out / "trl_pvpo.json", out / "trl_pvpo.md"
    json_path.write_text(json.dumps(payload, indent=2))
    md_path.write_text(markdown(payload, cfg))
    return {"summary_json": json_path, "summary_md": md_path, "plots": []}


def markdown(payload: dict[str, Any], cfg: TrainConfig) -> str:
    """The comparison as a markdown table (mean ± 95% t half-width over seeds)."""
    s = payload["summary"]
    lines = [
        "# Suite `trl-pvpo`: TRL `GRPOTrainer` beside `PVPOGRPOTrainer`",
        "",
        f"TRL {payload['trl_version']}; task `{cfg.task}`, model `{cfg.model}`, "
        f"{cfg.steps} steps of {cfg.rollout.prompts_per_step} prompts x N = {cfg.rollout.n} "
        f"from the first {cfg.train_prompts} training prompts; the same GRPOConfig for both; "
        f"PVPO: M = {payload['pvpo']['m']}, teacher {payload['pvpo']['teacher']!r}. Seeds "
        f"{', '.join(map(str, payload['seeds']))}; held-out accuracy on {cfg.eval.prompts} test "
        f"prompts (temperature {cfg.eval.temperature}, k = {cfg.eval.k}).",
        "",
        "| figure | GRPOTrainer | PVPOGRPOTrainer |",
        "| --- | ---: | ---: |",
    ]
    for key, label in FIGURES.items():
        digits = 3 if "eval" in key else 0 if key.startswith("rollouts") else 1
        lines.append(
            f"| {label} | {figure_cell(s['grpo'].get(key), digits)} | {figure_cell(s['pvpo'].get(key), digits)} |"
        )
    lines += ["", f"Command: `{payload['command']}`", ""]
    return "\n".join(lines)
