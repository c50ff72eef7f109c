"""Suite ``throughput``: rollout and update tokens per second of the built-in model sizes,
and the share of a step spent generating, scoring and updating.

Each size trains a few real steps of the ``grpo`` preset (``OUT/grpo+SIZE/seed0``, a normal
run directory) and its ``time/*`` metrics give, over the measured steps (the first step
is a warm-up and is left out when there are more):

* rollout tokens/s = policy tokens generated / seconds in ``time/generate``;
* update tokens/s = the same tokens / seconds in ``time/update`` (old and reference
  log-probs, advantage, optimizer step);
* the fraction of ``time/step`` in generate, score, update, sync (the new weights pushed to
  the rollout engine: nothing for an engine that shares the learner's model, a trip through
  the object store for Ray workers) and the rest;
* each throughput as a fraction of the machine's measured matmul FLOP/s at the run's
  shapes and thread count (:func:`peak_fractions`): 2 x parameters x rollout tokens/s,
  6 x parameters x update tokens/s.

The models are random inits (``random:SIZE``, no SFT run needed for the larger sizes): their
responses end at a random stop or eos token or at the budget, about half the budget on
average at every size, so the sizes generate similar token counts. On the CPU all sizes run;
on another device (``--device cuda``) only the largest. ``model=SPEC`` among the overrides
measures that one model instead (a Hugging Face model directory, ``random:base``...): its row
is named after the spec (a directory by its name) and its parameters and hidden width are
read from its config.

On the CPU, ``tiny`` and ``small`` also run in the other layouts of :data:`LAYOUTS` (one
thread per process: Ray rollout workers, learner ranks, asynchronous rollouts, whose
``generate`` time is the driver's wait so their s/step is the figure to compare, bf16, the
plain paths). A row's ``layout`` says which.
Writes ``throughput.json``, ``throughput.md`` and ``stage_time.png``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from anchor_rl.bench.host import host_info
from anchor_rl.bench.runner import BenchArgs, Suite, command_line, plan, run_spec
from anchor_rl.trainer.timing import STEP_STAGES

SIZE_ORDER = ("tiny", "small", "base")
STAGES = STEP_STAGES
WARMUP_STEPS = 1


@dataclass(frozen=True)
class Layout:
    """Where a throughput run's work goes.

    name: the row's label. threads: the driver's torch threads (None: the process's own).
    settings: config settings of the layout (``cluster.*``, the workers' threads).
    """

    name: str
    threads: int | None = None
    settings: dict[str, Any] = field(default_factory=dict)


def _cluster(
    workers: int = 0,
    learners: int = 1,
    async_steps: int = 0,
    sharding: str = "replicate",
    gpu_share: float = 0.0,
) -> dict[str, Any]:
    cluster: dict[str, Any] = {"rollout_workers": workers, "learners": learners}
    if async_steps:
        cluster["async_steps"] = async_steps
    if sharding != "replicate":
        cluster["learner_sharding"] = sharding
    table: dict[str, Any] = {"cluster": cluster}
    if workers:
        engine_args: dict[str, Any] = {"threads_per_worker": 1, "num_cpus_per_worker": 1}
        if gpu_share:
            engine_args["num_gpus_per_worker"] = gpu_share
        table["rollout"] = {"engine_args": engine_args}
    if learners > 1:
        cluster["threads_per_learner"] = 1
    return table


LAYOUTS: dict[str, Layout] = {
    "": Layout("1 process"),
    "t1": Layout("1 process, 1 thread", 1),
    "w1": Layout("1 rollout worker", 1, _cluster(workers=1)),
    "w2": Layout("2 rollout workers", 1, _cluster(workers=2)),
    "l2": Layout("2 learners", 1, _cluster(learners=2)),
    "l2f": Layout("2 learners, fsdp", 1, _cluster(learners=2, sharding="fsdp")),
    "w2l2": Layout("2 workers, 2 learners", 1, _cluster(workers=2, learners=2)),
    "w1a": Layout("1 rollout worker, async", 1, _cluster(workers=1, async_steps=1)),
    "t1b": Layout("1 process, 1 thread, bf16", 1, {"optim": {"autocast": "bf16"}}),
    "t1bs": Layout(
        "1 process, 1 thread, bf16 + bf16 sampling",
        1,
        {"optim": {"autocast": "bf16"}, "rollout": {"engine_args": {"precision": "bf16"}}},
    ),
    "t1n": Layout("1 process, 1 thread, no shared prefix", 1, {"optim": {"shared_prefix": "off"}}),
    # GPU layouts: Ray rollout workers sampling on a share of the learner's GPU
    "g1": Layout("1 GPU rollout worker", None, _cluster(workers=1, gpu_share=0.4)),
    "g2": Layout("2 GPU rollout workers", None, _cluster(workers=2, gpu_share=0.4)),
    "t1p": Layout(
        "1 process, 1 thread, plain",
        1,
        {"rollout": {"engine_args": {"decode": "hf"}}, "optim": {"padding_free": "off"}},
    ),
}
"""The layouts by key (the key suffixes the size in the run's label: ``grpo+tiny-w2``); the
one-process layout at the process's threads has the empty key (label ``grpo+tiny``)."""
CLUSTER_SIZES = ("tiny", "small")
"""The sizes measured in every CPU layout on the CPU (the others in one process only)."""
GPU_LAYOUTS = ("g1", "g2")
"""Layouts that need a GPU (never among the CPU's defaults; chosen by name on a GPU)."""


def _variant(size: str, layout: str) -> str:
    return f"{size}-{layout}" if layout else size


@contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """torch's thread count set to ``n`` for the block (unchanged for None)."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def throughput_suite(
    models: Mapping[str, str] | None = None, variants: Collection[str] | None = None
) -> Suite:
    """The suite: ``grpo`` at the trainer's default scale (8 prompts x 8 responses, 80 new
    tokens), 3 steps, one variant per model and layout; profile ``quick`` is a 1-step smoke
    run. ``models``: row name -> model spec (default: ``random:SIZE`` for every size);
    ``variants``: the variant labels kept (default: all)."""
    if models is None:
        models = {size: f"random:{size}" for size in SIZE_ORDER}
    return Suite(
        name="throughput",
        description="tokens per second and stage shares of the built-in sizes",
        presets=["grpo"],
        seeds=[0],
        base={
            "task": "arithmetic",
            "steps": 3,
            "rollout": {"prompts_per_step": 8, "n": 8, "max_new_tokens": 80},
            "eval": {"every": 0},
            "checkpoint": {"every": 0},
            "log": {"tensorboard": False, "progress": True},
        },
        variants={
            _variant(name, key): {"model": spec, **layout.settings}
            for name, spec in models.items()
            for key, layout in LAYOUTS.items()
            if variants is None or _variant(name, key) in variants
        },
        profiles={
            "quick": {
                "steps": 1,
                "rollout": {"prompts_per_step": 2, "n": 2, "max_new_tokens": 8},
                "log": {"progress": False},
            }
        },
    )


def default_sizes(device: str, profile: str | None = None) -> tuple[str, ...]:
    """Every size on the CPU, the largest elsewhere; ``tiny`` for the quick profile."""
    if profile == "quick":
        return ("tiny",)
    return SIZE_ORDER if device == "cpu" else SIZE_ORDER[-1:]


def default_layouts(device: str, size: str, profile: str | None = None) -> tuple[str, ...]:
    """The layout keys of ``size``: all of them for :data:`CLUSTER_SIZES` on the CPU, else
    the one process (and only that in the quick profile)."""
    if device == "cpu" and profile != "quick" and size in CLUSTER_SIZES:
        return tuple(k for k in LAYOUTS if k not in GPU_LAYOUTS)
    return ("",)


def _stage_seconds(record: Mapping[str, float], stage: str) -> float:
    if stage == "sync":  # a run without a sync timer counts its weight push in time/update
        return record.get("time/sync", 0.0)
    return record[f"time/{stage}"]


def stage_figures(
    records: Sequence[Mapping[str, float]], warmup: int = WARMUP_STEPS
) -> dict[str, float]:
    """Throughput figures of one run from its metric records.

    The first ``warmup`` training steps are left out when more steps than that exist.
    Returns ``steps`` (measured), ``tokens_per_step``, ``s_per_step``, ``rollout_tok_s`` (not
    for asynchronous rollouts), ``update_tok_s`` and ``frac_<stage>`` for each of
    :data:`STAGES` and ``other`` (shares of the summed ``time/step``).
    """
    steps = [r for r in records if r["step"] > 0]
    if not steps:
        raise ValueError("the run has no training step in its metrics")
    measured = steps[warmup:] if len(steps) > warmup else steps
    tokens = sum(r["tokens/step"] for r in measured)
    seconds = {s: sum(_stage_seconds(r, s) for r in measured) for s in STAGES}
    total = sum(r["time/step"] for r in measured)
    out = {
        "steps": float(len(measured)),
        "tokens_per_step": tokens / len(measured),
        "s_per_step": total / len(measured),
        "update_tok_s": tokens / seconds["update"],
    }
    # with asynchronous rollouts ``time/generate`` is the wait for a prefetched batch, not
    # the sampling: no rollout tokens/s (the step time shows the overlap)
    if not any(r.get("async/staleness", 0) > 0 for r in measured):
        out["rollout_tok_s"] = tokens / seconds["generate"]
    for stage in STAGES:
        out[f"frac_{stage}"] = seconds[stage] / total
    out["frac_other"] = 1.0 - sum(out[f"frac_{s}"] for s in STAGES)
    return out


def matmul_flops(
    rows: int, hidden: int, device: str = "cpu", repeats: int = 10, dtype: str = "float32"
) -> float:
    """Measured FLOP/s of a ``[rows, hidden] @ [hidden, hidden]`` matmul in ``dtype``
    (``float32``, ``bfloat16``) on ``device`` at the current thread count: the best of
    ``repeats`` timed calls after a warm-up (2 * rows * hidden^2 FLOPs each)."""
    import time

    import torch

    a = torch.randn(rows, hidden, device=device, dtype=getattr(torch, dtype))
    b = torch.randn(hidden, hidden, device=device, dtype=getattr(torch, dtype))
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        start = time.perf_counter()
        for _ in range(8):
            a @ b
        sync()
        if i:  # the first round is the warm-up
            best = min(best, (time.perf_counter() - start) / 8)
    return 2 * rows * hidden * hidden / best


def peak_fractions(
    figures: Mapping[str, float],
    parameters: int,
    hidden: int,
    batch: int,
    device: str = "cpu",
    dtypes: tuple[str, str] = ("float32", "float32"),
) -> dict[str, float]:
    """How close a run comes to the machine's matmul speed at its own shapes.

    ``matmul_flops_decode`` is measured at one decode step's shape (``batch`` rows: the
    step's responses), ``matmul_flops_update`` at the update's (``tokens_per_step`` rows);
    ``rollout_peak_frac`` = 2 * parameters * rollout tokens/s over the first,
    ``update_peak_frac`` = 6 * parameters * update tokens/s over the second (forward and
    backward, the policy's tokens only: prompts and the old and reference passes are work
    the figure does not credit, so it is a lower bound). ``dtypes``: the matmuls' dtype
    when sampling and when updating (``bfloat16`` for bf16 sampling or autocast).
    """
    decode = matmul_flops(batch, hidden, device, dtype=dtypes[0])
    update = matmul_flops(
        max(1, round(figures["tokens_per_step"])), hidden, device, dtype=dtypes[1]
    )
    out = {
        "matmul_flops_decode": decode,
        "matmul_flops_update": update,
        "update_peak_frac": 6 * parameters * figures["update_tok_s"] / update,
    }
    if "rollout_tok_s" in figures:
        out["rollout_peak_frac"] = 2 * parameters * figures["rollout_tok_s"] / decode
    return out


def matmul_dtypes(cfg: Any) -> tuple[str, str]:
    """The dtype of a run's matmuls when sampling and when updating: ``bfloat16`` under
    ``rollout.engine_args.precision=bf16`` and ``optim.autocast=bf16``, else ``float32``
    (the models' own dtype: the suite's are float32 inits)."""
    bf16 = "bfloat16"
    sampling = bf16 if cfg.rollout.engine_args.get("precision") == "bf16" else "float32"
    return sampling, bf16 if cfg.optim.autocast == "bf16" else "float32"


def model_name(spec: str) -> str:
    """A row and run-directory name for a model spec: a directory's own name, else the spec
    with anything but letters, digits, ``.`` and ``_`` made ``_`` (``random:base`` ->
    ``random_base``)."""
    name = Path(spec).name if (Path(spec) / "config.json").is_file() else spec
    return re.sub(r"[^A-Za-z0-9_.]", "_", name)


def model_shape(spec: str) -> tuple[int, int]:
    """``(parameters, hidden width)`` of a model spec: a built-in size's (``random:SIZE``,
    ``sft:SIZE``, ``teacher:SIZE``) or a Hugging Face directory's, read from its config and
    counted on the meta device (tied embeddings once, no weights loaded)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from anchor_rl.errors import AnchorRLError
    from anchor_rl.models.factory import SIZES, model_config
    from anchor_rl.models.tokenizer import build_tokenizer

    kind, _, size = spec.partition(":")
    if kind in {"random", "sft", "teacher"} and size in SIZES:
        config = model_config(size, build_tokenizer())
    elif (Path(spec) / "config.json").is_file():
        config = AutoConfig.from_pretrained(spec)
    else:
        raise AnchorRLError(
            f"model {spec!r} is neither a model directory (no config.json there) nor a spec "
            f"like random:base; sizes: {', '.join(SIZES)}"
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters()), int(config.hidden_size)


def run_throughput_suite(
    args: BenchArgs,
    sizes: Sequence[str] | None = None,
    layouts: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Train each size in each layout for a few steps (finished runs are reused) and write
    the figures.

    ``sizes`` defaults to :func:`default_sizes` for the runs' device, ``layouts`` (keys of
    :data:`LAYOUTS`) to :func:`default_layouts` per size. Returns ``{"summary_json",
    "summary_md", "plots"}`` paths.
    """
    out, seeds, steps, overrides, profile, echo = args.unpack()
    from anchor_rl.trainer.logging import read_metrics
    from anchor_rl.trainer.presets import parse_override

    # ``model=SPEC`` names the one model measured (a row of its own), not every variant's
    cli = dict(parse_override(o) for o in overrides)
    settings = [o for o in overrides if parse_override(o)[0] != "model"]
    device = str(cli.get("device", "cpu"))
    if "model" in cli:
        if sizes is not None:
            raise ValueError("give either sizes or a model=SPEC override, not both")
        models = {model_name(str(cli["model"])): str(cli["model"])}
    else:
        wanted = tuple(sizes) if sizes is not None else default_sizes(device, profile)
        unknown = set(wanted) - set(SIZE_ORDER)
        if unknown:
            raise ValueError(f"unknown sizes {sorted(unknown)}; sizes: {', '.join(SIZE_ORDER)}")
        models = {size: f"random:{size}" for size in wanted}
    if layouts is not None and (bad := set(layouts) - set(LAYOUTS)):
        raise ValueError(f"unknown layouts {sorted(bad)}; layouts: {', '.join(map(repr, LAYOUTS))}")
    chosen = {
        _variant(size, key): (size, key)
        for size in models
        for key in (layouts if layouts is not None else default_layouts(device, size, profile))
    }
    # only the chosen runs are planned (a layout another device cannot run is not validated)
    specs = plan(throughput_suite(models, chosen), out, seeds, steps, settings, profile)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, spec in enumerate(specs, 1):
        size, key = chosen[spec.label.split("+")[1]]
        layout = LAYOUTS[key]
        echo(f"[{i}/{len(specs)}] {size}, {layout.name}, seed {spec.seed} -> {spec.run_dir}")
        parameters, hidden = model_shape(models[size])
        with _threads(layout.threads):
            import torch  # the layout's threads in every phase, not threads=auto's choice

            update = {"threads": torch.get_num_threads()}
            spec = replace(spec, config=spec.config.model_copy(update=update))
            run_spec(spec)
            figures = stage_figures(read_metrics(spec.run_dir))
            batch = spec.config.rollout.prompts_per_step * spec.config.rollout.n
            figures |= peak_fractions(
                figures, parameters, hidden, batch, device, matmul_dtypes(spec.config)
            )
        rows.append(
            {
                "size": size,
                "model": models[size],
                "layout": layout.name,
                "driver_threads": layout.threads,
                "seed": spec.seed,
                "dir": str(spec.run_dir),
                "parameters": parameters,
                "figures": figures,
            }
        )
    cfg = specs[0].config
    command = command_line("throughput", out, seeds, steps, overrides, profile)
    if sizes is not None or layouts is not None:  # a subset the CLI does not choose
        command += f" (from Python: run_throughput_suite(..., sizes={tuple(models)!r}, layouts="
        command += f"{None if layouts is None else tuple(layouts)!r}))"
    payload = {
        "suite": "throughput",
        "command": command,
        "host": host_info(device),
        "settings": {
            "preset": cfg.preset,
            "task": cfg.task,
            "steps": cfg.steps,
            "warmup_steps_excluded": WARMUP_STEPS if cfg.steps > WARMUP_STEPS else 0,
            "prompts_per_step": cfg.rollout.prompts_per_step,
            "n": cfg.rollout.n,
            "max_new_tokens": cfg.rollout.max_new_tokens,
            "kl_coef": cfg.kl.coef,
            "matmul_dtypes": dict(zip(("rollout", "update"), matmul_dtypes(cfg), strict=True)),
        },
        "rows": rows,
    }
    json_path, md_path = out / "throughput.json", out / "throughput.md"
    json_path.write_text(json.dumps(payload, indent=2))
    md_path.write_text(markdown(payload))
    plot = out / "stage_time.png"
    plot_stages(rows, plot)
    return {"summary_json": json_path, "summary_md": md_path, "plots": [plot]}


def _count(value: float | None) -> str:
    return "–" if value is None else f"{value:.0f}"


def _share(value: float | None) -> str:
    """A stage's share of the step, "–" where the run did not time it."""
    return "–" if value is None else f"{100 * value:.1f}%"


def markdown(payload: Mapping[str, Any]) -> str:
    """The figures as a markdown table, with the setting and the command."""
    host, s = payload["host"], payload["settings"]
    lines = [
        "# Suite `throughput`",
        "",
        f"Device {host['device']} ({host['device_name']}), {host['torch_threads']} torch "
        f"thread(s), torch {host['versions']['torch']}. Preset `{s['preset']}` on "
        f"`{s['task']}`: {s['prompts_per_step']} prompts x {s['n']} responses per step, at most "
        f"{s['max_new_tokens']} new tokens, KL beta {s['kl_coef']:g} (a reference forward pass "
        f"per step); models: {', '.join(sorted({r.get('model', 'random init') for r in payload['rows']}))}; "
        f"{s['steps']} steps, the first "
        f"{s['warmup_steps_excluded']} left out as warm-up.",
        "",
        "Rollout tokens/s: policy tokens / seconds generating. Update tokens/s: the same tokens "
        "/ seconds in log-probs (old and reference policy), advantage and the optimizer step. "
        "Shares are of the whole step. Of peak: 2 x parameters x rollout tokens/s (6 x for the "
        "update) over this machine's measured matmul FLOP/s at the run's own shapes, dtype "
        f"({s.get('matmul_dtypes', {}).get('rollout', 'float32')} sampling, "
        f"{s.get('matmul_dtypes', {}).get('update', 'float32')} update) "
        "and thread count (a decode step's rows; the step's policy tokens).",
        "",
        "| size | layout | parameters | tokens/step | rollout tok/s | update tok/s | s/step "
        "| generate | score | update | sync | other | rollout of peak | update of peak |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |",
    ]
    for row in payload["rows"]:
        f = row["figures"]
        lines.append(
            f"| {row['size']} | {row.get('layout', '1 process')} | {row['parameters'] / 1e6:.1f}M "
            f"| {f['tokens_per_step']:.0f} | "
            f"{_count(f.get('rollout_tok_s'))} | {f['update_tok_s']:.0f} | {f['s_per_step']:.2f} | "
            + " | ".join(_share(f.get(f"frac_{k}")) for k in (*STAGES, "other"))
            + " | "
            + " | ".join(
                f"{100 * f[key]:.1f}%" if key in f else "–"
                for key in ("rollout_peak_frac", "update_peak_frac")
            )
            + " |"
        )
    lines += ["", f"Command: `{payload['command']}`", ""]
    return "\n".join(lines)


def plot_stages(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """Horizontal stacked bars: seconds per step in each stage, one bar per size."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(6.4, 1.2 + 0.6 * len(rows)), layout="constrained")
    ax = fig.subplots()
    labels = [f"{r['size']}, {r.get('layout', '1 process')}" for r in rows]
    left = [0.0] * len(rows)
    for stage in (*STAGES, "other"):
        widths = [r["figures"].get(f"frac_{stage}", 0.0) * r["figures"]["s_per_step"] for r in rows]
        ax.barh(labels, widths, left=left, label=stage)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("seconds per step")
    ax.invert_yaxis()
    ax.set_title("where a step's time goes")
    fig.legend(fontsize=8, ncols=4, loc="outside lower center")
    fig.savefig(path, dpi=110)
