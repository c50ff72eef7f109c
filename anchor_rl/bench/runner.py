"""Benchmark suites: a matrix of presets x variants x seeds, each run in its own directory.

A suite is a TOML file (``anchor_rl/bench/suites/NAME.toml`` or any path)::

    description = "what the suite compares"
    presets = ["grpo", "dapo"]          # trainer presets
    seeds = [0, 1, 2]

    [base]                              # config set for every run (sections as in TrainConfig)
    task = "arithmetic"
    steps = 40
    [base.rollout]
    n = 8

    [per_preset.pvpo]                   # optional: settings for the runs of one preset only
    pvpo = { m = 5 }                    #   (a method's section, meaningless to the others)

    [variants.n4]                       # optional: named extra settings, crossed with presets
    rollout = { n = 4 }

    [profiles.quick]                    # optional: a named layer picked with --profile/--quick
    steps = 2
    per_preset = { pvpo = { pvpo = { m = 2 } } }   # a profile may hold per-preset settings too
    variants = { n4 = { rollout = { n = 2 } } }    # and per-variant ones (after the variant's)

    runs = ["grpo+n4", "dapo"]          # optional: only these cells of presets x variants
    target_accuracy = 0.5               # optional: wall time and rollouts to reach it and stay
    target_metric = "eval/train_accuracy"  # optional: the metric it applies to (default eval/accuracy)
    baseline = "grpo"                   # optional: the run label the paired table compares to
                                        #   (default: the first label)
    budget = "max"                      # optional: the common rollout budget, "max" or a number
    to_budget = ["grpo+n2"]             #   and the cells run to it (budget.rollouts) instead
                                        #   of to their steps
    shared_anchors = true               # optional: a sweep, one anchor store and draw for all

Settings apply in this order: preset, ``base``, ``per_preset``, the profile (its own
``per_preset`` last), the variant, the profile's settings for that variant, ``seed``, the
command line (``--steps``, ``key=value``). A run that reads PVPO's anchors and sets no
``pvpo.presample_seed`` draws them with its own ``seed``, so a suite's spread over seeds
includes the anchors' sampling noise (a training run's default anchor seed is 0, shared by
every seed). With ``shared_anchors = true`` the suite is a sweep
(:mod:`anchor_rl.bench.sweep`): every run that reads anchors draws them once for the whole
suite (one ``pvpo.presample_seed``, one store, ``OUT/anchors.db`` unless set), and the
summary adds the sweep's cost per run, cumulative cost and break-even k.

With ``budget`` and ``to_budget``, the cells in ``to_budget`` run to a common budget of
total rollouts (``budget.rollouts``, :mod:`anchor_rl.trainer.budget`) rather than to their
steps: a number, or ``"max"``, the largest ``rollouts/total`` any other run of the suite
ended with (those run first). Their ``steps`` becomes a cap, raised to what the budget needs
(every step spends at least ``prompts_per_step x n`` rollouts). The summary then compares
every label at fractions of the budget and by the area under its held-out curve
(:mod:`anchor_rl.bench.budget`), against rollouts, wall seconds and modelled seconds
(:mod:`anchor_rl.bench.costs`). Every run's config is validated before the first run starts. Finished runs (``summary.json`` present) are skipped and stopped ones resume
from their checkpoint, so re-running a suite command continues it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from anchor_rl.trainer.config import ConfigError, TrainConfig, apply_overrides, build_config
from anchor_rl.trainer.presets import parse_override, read_builtin_toml, read_preset


@dataclass(frozen=True)
class Suite:
    """A parsed suite file."""

    name: str
    description: str
    presets: list[str]
    seeds: list[int]
    base: dict[str, Any] = field(default_factory=dict)
    per_preset: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Preset name -> settings for that preset's runs only (after ``base``)."""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)
    runs: list[str] = field(default_factory=list)
    """Labels (``preset`` or ``preset+variant``) of the cells to run; empty: every cell."""
    target_accuracy: float | None = None
    """Accuracy the summary times the runs to (``target_*`` figures): reached at the evaluation
    from which the curve stays at or above it (:func:`~anchor_rl.bench.summary.first_sustained`)."""
    target_metric: str = "eval/accuracy"
    """The metric ``target_accuracy`` applies to (``eval/train_accuracy``: training prompts)."""
    baseline: str | None = None
    """The run label the paired comparisons over held-out prompts compare every other label
    to (None: the first label)."""
    budget: int | str | None = None
    """The common rollout budget: a number of total rollouts, or ``"max"``, the largest total
    of the runs not in ``to_budget`` (None: no budget; every cell runs its steps)."""
    to_budget: list[str] = field(default_factory=list)
    """Labels of the cells run to ``budget`` (``budget.rollouts``) instead of their steps."""
    shared_anchors: bool = False
    """A sweep: the runs that read anchors share one store and one anchor draw, and the
    summary adds the sweep's cost summary (:mod:`anchor_rl.bench.sweep`)."""


SUITE_KEYS = {f.name for f in fields(Suite)} - {"name"}
"""The keys a suite file may hold."""


@dataclass(frozen=True)
class BenchArgs:
    """What ``anchor-rl bench`` gives every suite runner (a suite file's ``run_suite``, and the
    function suites ``trl``, ``throughput``, ``baseline-mse``).

    out: the suite's output directory. seeds: the seeds to run (None: the suite's).
    steps: training steps of every run (None: the suite's). overrides: ``key=value``
    settings for every run. profile: a profile of the suite (``quick``: a CI-sized run).
    echo: where progress lines go.
    """

    out: Path
    seeds: Sequence[int] | None = None
    steps: int | None = None
    overrides: Sequence[str] = ()
    profile: str | None = None
    echo: Callable[[str], None] = print

    def unpack(
        self,
    ) -> tuple[Path, Sequence[int] | None, int | None, Sequence[str], str | None, Callable]:
        """``(out as a Path, seeds, steps, overrides, profile, echo)``, for a runner's locals."""
        return Path(self.out), self.seeds, self.steps, self.overrides, self.profile, self.echo


@dataclass(frozen=True)
class RunSpec:
    """One cell of the matrix: its label, seed, validated config and directory."""

    label: str
    seed: int
    config: TrainConfig
    run_dir: Path
    to_budget: bool = False
    """Whether the cell runs to the suite's common budget (``budget.rollouts``)."""


def load_suite(name_or_path: str, others: Sequence[str] = ()) -> Suite:
    """A built-in suite by name or a suite TOML file by path; an unknown name's error lists
    the built-in suites and ``others`` (the function suites ``anchor-rl bench`` runs)."""
    table, name = read_builtin_toml("suite", "anchor_rl.bench", "suites", name_or_path, others)
    unknown = set(table) - SUITE_KEYS
    if unknown:
        raise ConfigError(
            f"suite {name!r}: unknown keys {sorted(unknown)}; allowed: {sorted(SUITE_KEYS)}"
        )
    if not table.get("presets"):
        raise ConfigError(f"suite {name!r}: `presets` must list at least one preset")
    per_preset = [table.get("per_preset", {})]
    per_preset += [p.get("per_preset", {}) for p in table.get("profiles", {}).values()]
    if unused := sorted({k for layer in per_preset for k in layer} - set(table["presets"])):
        raise ConfigError(f"suite {name!r}: per_preset names {unused}, not among its presets")
    check_budget(name, table.get("budget"), table.get("to_budget", []))
    if not isinstance(table.get("shared_anchors", False), bool):
        raise ConfigError(f"suite {name!r}: shared_anchors must be true or false")
    return Suite(
        name=name,
        description=table.get("description", ""),
        presets=list(table["presets"]),
        seeds=list(table.get("seeds", [0])),
        base=table.get("base", {}),
        per_preset=table.get("per_preset", {}),
        variants=table.get("variants", {}),
        profiles=table.get("profiles", {}),
        runs=list(table.get("runs", [])),
        target_accuracy=table.get("target_accuracy"),
        target_metric=table.get("target_metric", "eval/accuracy"),
        baseline=table.get("baseline"),
        budget=table.get("budget"),
        to_budget=list(table.get("to_budget", [])),
        shared_anchors=table.get("shared_anchors", False),
    )


def check_budget(name: str, budget: Any, to_budget: Sequence[str]) -> None:
    """ConfigError unless ``budget`` is None, ``"max"`` or a positive whole number, and
    ``to_budget`` names cells exactly when there is a budget."""
    ok = budget is None or budget == "max" or (type(budget) is int and budget > 0)
    if not ok:
        raise ConfigError(
            f'suite {name!r}: budget must be "max" or a positive number of rollouts, got {budget!r}'
        )
    if budget is not None and not to_budget:
        raise ConfigError(f"suite {name!r}: budget is set but to_budget names no cell to run to it")
    if budget is None and to_budget:
        raise ConfigError(f'suite {name!r}: to_budget {list(to_budget)} needs budget ("max" or N)')


def budget_options(suite: Suite, budget: str | None, to_budget: str | None) -> Suite:
    """``suite`` with the command line's ``--budget`` (``max`` or a number) and
    ``--to-budget`` (comma-separated labels) in place of its own, checked."""
    import dataclasses

    value: int | str | None = suite.budget
    if budget is not None:
        try:
            value = budget if budget == "max" else int(budget)
        except ValueError:
            raise ConfigError(f"--budget must be max or a number, got {budget!r}") from None
    labels = suite.to_budget
    if to_budget is not None:
        labels = [x.strip() for x in to_budget.split(",") if x.strip()]
    check_budget(suite.name, value, labels)
    return dataclasses.replace(suite, budget=value, to_budget=labels)


def plan(
    suite: Suite,
    out: Path,
    seeds: Sequence[int] | None = None,
    steps: int | None = None,
    overrides: Sequence[str] = (),
    profile: str | None = None,
) -> list[RunSpec]:
    """Every run of the suite with its validated config; raises ConfigError before any run.

    Directories: ``OUT/<preset>[+<variant>]/seed<k>``.
    """
    if profile is not None and profile not in suite.profiles:
        known = ", ".join(suite.profiles) or "none"
        raise ConfigError(f"suite {suite.name!r} has no profile {profile!r} (profiles: {known})")
    cli = dict(parse_override(o) for o in overrides)
    if steps is not None:
        cli["steps"] = steps
    chosen = dict(suite.profiles.get(profile, {})) if profile else {}
    profile_per_preset = chosen.pop("per_preset", {})
    profile_variants = chosen.pop("variants", {})
    if unknown := sorted(set(profile_variants) - set(suite.variants)):
        raise ConfigError(f"suite {suite.name!r}, profile {profile!r}: no variants {unknown}")
    # every preset bare and crossed with each variant; without `runs`, the bare presets run
    # only when the suite has no variants
    variants = {"": {}, **suite.variants}
    labels = [f"{p}+{v}" if v else p for p in suite.presets for v in variants]
    if missing := [r for r in suite.runs if r not in labels]:
        raise ConfigError(f"suite {suite.name!r}: runs {missing} are not among {labels}")
    chosen_labels = suite.runs or [x for x in labels if "+" in x or not suite.variants]
    if missing := [r for r in suite.to_budget if r not in chosen_labels]:
        raise ConfigError(f"suite {suite.name!r}: to_budget {missing} are not among its runs "
                          f"{chosen_labels}")  # fmt: skip
    if suite.budget == "max" and not set(chosen_labels) - set(suite.to_budget):
        raise ConfigError(f"suite {suite.name!r}: budget = \"max\" needs a run not in to_budget "
                          "to take the budget from")  # fmt: skip
    specs = []
    for preset in suite.presets:
        for variant, settings in variants.items():
            label = f"{preset}+{variant}" if variant else preset
            wanted = label in suite.runs if suite.runs else bool(variant) or not suite.variants
            if not wanted:
                continue
            for seed in seeds if seeds is not None else suite.seeds:
                table = read_preset(preset)
                layers = (
                    suite.base, suite.per_preset.get(preset, {}), chosen,
                    profile_per_preset.get(preset, {}), settings,
                    profile_variants.get(variant, {}), {"seed": seed},
                )  # fmt: skip
                for layer in layers:
                    table = _merge(table, layer)
                try:
                    cfg = build_config(apply_overrides(table, cli))
                    if _reads_anchors(cfg) and (draw := _anchor_draw(suite, cfg, seed, out)):
                        table = _merge(table, {"pvpo": draw})
                        cfg = build_config(apply_overrides(table, cli))
                except ConfigError as e:
                    raise ConfigError(
                        f"suite {suite.name!r}, run {label} seed {seed}: {e}"
                    ) from None
                run_dir = Path(out) / label / f"seed{seed}"
                spec = RunSpec(label, seed, cfg, run_dir, to_budget=label in suite.to_budget)
                if spec.to_budget:  # validated with the budget; "max": a stand-in until known
                    number = suite.budget if isinstance(suite.budget, int) else 1
                    spec = with_budget(spec, number, f"suite {suite.name!r}, run {label}")
                specs.append(spec)
    if suite.shared_anchors:
        from anchor_rl.bench.sweep import check_shared

        draws = {f"{s.label} seed {s.seed}": (s.config.pvpo.store, s.config.pvpo.presample_seed)
                 for s in specs if _reads_anchors(s.config)}  # fmt: skip
        check_shared(suite.name, draws)
    _check_tasks(specs)
    return specs


def _anchor_draw(suite: Suite, cfg: TrainConfig, seed: int, out: Path) -> dict[str, Any]:
    """The ``pvpo`` settings of an anchor-reading run's draw: a sweep's one draw
    (:func:`~anchor_rl.bench.sweep.shared_anchor_settings`), else the run's seed when it
    sets no ``presample_seed``."""
    if suite.shared_anchors:
        from anchor_rl.bench.sweep import shared_anchor_settings

        return shared_anchor_settings(cfg.pvpo, out)
    return {"presample_seed": seed} if cfg.pvpo.presample_seed is None else {}


def _reads_anchors(cfg: TrainConfig) -> bool:
    """Whether a run reads PVPO's presampled anchors (PVPO, or V0.5 with an anchor prior)."""
    anchor_prior = cfg.v05.prior.split("+")[0] == "anchor"
    return "pvpo" in cfg.methods or ("v05" in cfg.methods and anchor_prior)


def _check_tasks(specs: Sequence[RunSpec]) -> None:
    """Build each distinct task once, so a bad task name or argument fails before any run."""
    from anchor_rl.trainer.run import load_task

    seen = set()
    for spec in specs:
        key = (spec.config.task, json.dumps(spec.config.task_args, sort_keys=True))
        if key not in seen:
            seen.add(key)
            load_task(spec.config)


def run_spec(spec: RunSpec) -> None:
    """Train one run to completion: skip a finished one, resume a stopped one.

    A finished run (its ``summary.json`` at the same step count) is skipped even without
    checkpoints, so a directory of compact results (``scripts/compact_results.py``) can be
    extended by new runs without re-running the old ones.

    A directory holding a run of a different config (besides ``steps`` and what it logs)
    is an error, never silently reused.
    """
    from anchor_rl.trainer.checkpoint import list_checkpoints
    from anchor_rl.trainer.loop import train
    from anchor_rl.trainer.run import CONFIG_FILE, SUMMARY_FILE, resume_run, start_run

    stored = spec.run_dir / CONFIG_FILE
    finished = (spec.run_dir / SUMMARY_FILE).is_file()
    if stored.is_file() and (finished or list_checkpoints(spec.run_dir)):
        _check_same_run(spec, json.loads(stored.read_text()))
        if finished and _finished_as_asked(spec):
            return  # finished: kept even when its checkpoints were pruned (compact results)
        if list_checkpoints(spec.run_dir):
            budget = {"budget.rollouts": spec.config.budget.rollouts}
            train(resume_run(spec.run_dir, {"steps": spec.config.steps, **budget}))
            return
        raise ConfigError(
            f"{spec.run_dir} holds a finished run of {_stored_steps(spec)} steps without a "
            f"checkpoint to resume to {spec.config.steps}; pass another --out or delete it"
        )
    if spec.run_dir.exists():
        shutil.rmtree(spec.run_dir)  # started but stopped before its first checkpoint
    train(start_run(spec.config, spec.run_dir))


def _check_same_run(spec: RunSpec, stored: dict[str, Any]) -> None:
    from anchor_rl.trainer.run import RESUMABLE_KEYS

    def learning(table: dict[str, Any]) -> dict[str, Any]:
        sections = {k.rstrip(".") for k in RESUMABLE_KEYS}
        return {k: v for k, v in table.items() if k not in sections}

    # A field added since the run started reads as its default; a field since removed or
    # renamed fails validation and is compared as stored, so the configs differ.
    with contextlib.suppress(ValueError):
        stored = TrainConfig.model_validate(stored).model_dump(mode="json")
    if learning(stored) != learning(spec.config.model_dump(mode="json")):
        raise ConfigError(
            f"{spec.run_dir} holds a run with a different config; pass another --out or delete it"
        )


def _finished_as_asked(spec: RunSpec) -> bool:
    """Whether the finished run in ``spec.run_dir`` ran what ``spec`` asks: its steps, or its
    budget (a run that reached the same ``budget.rollouts``). ConfigError for a run that
    reached another budget: resuming it would not evaluate at the new budget's fractions."""
    from anchor_rl.trainer.run import SUMMARY_FILE

    summary = json.loads((spec.run_dir / SUMMARY_FILE).read_text())
    wanted = spec.config.budget.rollouts
    if summary.get("stop") == "budget":
        if summary.get("budget_rollouts") != wanted:
            raise ConfigError(
                f"{spec.run_dir} holds a run to a budget of {summary.get('budget_rollouts')} "
                f"rollouts; the suite now asks {wanted}: delete the to_budget runs' directories "
                "or pass another --out"
            )
        return True
    return summary["steps"] == spec.config.steps


def _stored_steps(spec: RunSpec) -> int:
    from anchor_rl.trainer.run import SUMMARY_FILE

    return json.loads((spec.run_dir / SUMMARY_FILE).read_text())["steps"]


def run_suite(
    suite: Suite,
    args: BenchArgs,
) -> dict[str, Any]:
    """Plan, validate, run every cell in turn, then write the summary and the plots.

    Returns ``{"summary_json", "summary_md", "plots"}`` paths.
    """
    out, seeds, steps, overrides, profile, echo = args.unpack()
    specs = plan(suite, out, seeds, steps, overrides, profile)
    Path(out).mkdir(parents=True, exist_ok=True)
    # the cells run to their steps first: a budget of "max" is read from them
    order = [i for i, s in enumerate(specs) if not s.to_budget]
    order += [i for i, s in enumerate(specs) if s.to_budget]
    budget = suite.budget if isinstance(suite.budget, int) else None
    for n, i in enumerate(order, 1):
        spec = specs[i]
        if spec.to_budget:
            if budget is None:
                budget = max_rollouts([s for s in specs if not s.to_budget])
                echo(f"common budget: {budget:,} rollouts (the most any other run spent)")
            spec = specs[i] = with_budget(spec, budget, f"suite {suite.name!r}, run {spec.label}")
        echo(f"[{n}/{len(specs)}] {spec.label} seed {spec.seed} -> {spec.run_dir}")
        run_spec(spec)
    return report(
        suite.name, specs, Path(out), suite.target_accuracy, suite.target_metric, suite.baseline,
        budget=None if suite.budget is None else {"rollouts": budget, "mode": suite.budget,
                                                  "to_budget": list(suite.to_budget)},
        sweep=suite.shared_anchors, order=order,
    )  # fmt: skip


def with_budget(spec: RunSpec, rollouts: int, where: str) -> RunSpec:
    """``spec`` run to ``rollouts`` total rollouts: ``budget.rollouts`` set and ``steps``, the
    cap, raised to ``ceil(rollouts / (prompts_per_step x n))`` (every step spends at least
    that many), so the budget, not the cap, ends the run."""
    import math

    cfg = spec.config
    need = math.ceil(rollouts / (cfg.rollout.prompts_per_step * cfg.rollout.n))
    table = apply_overrides(
        cfg.model_dump(mode="json"), {"budget.rollouts": rollouts, "steps": max(cfg.steps, need)}
    )
    try:
        config = build_config(table)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    return RunSpec(spec.label, spec.seed, config, spec.run_dir, to_budget=True)


def max_rollouts(specs: Sequence[RunSpec]) -> int:
    """The largest final ``rollouts/total`` of the finished runs of ``specs``."""
    from anchor_rl.trainer.logging import read_metrics

    totals = [
        r.get("rollouts/total", r.get("rollouts/cumulative", 0.0))
        for spec in specs
        for r in read_metrics(spec.run_dir)[-1:]
    ]
    if not totals:
        raise ConfigError('budget = "max": no finished run to take the budget from')
    return int(max(totals))


def report(
    name: str,
    specs: Sequence[RunSpec],
    out: Path,
    target: float | None = None,
    metric: str = "eval/accuracy",
    baseline: str | None = None,
    budget: Mapping[str, Any] | None = None,
    sweep: bool = False,
    order: Sequence[int] | None = None,
) -> dict[str, Any]:
    """summary.json, summary.md and the accuracy plots of finished runs (``target``: the
    value of ``metric`` the runs are timed to, where they reach it and stay; ``baseline``:
    the label the comparisons over held-out prompts compare to, default the first;
    ``budget``: the suite's common budget, ``{"rollouts", "mode", "to_budget"}``, for the
    comparisons at equal budget, :func:`~anchor_rl.bench.budget.suite_comparison`; ``sweep``:
    add the sweep's cost summary, :func:`~anchor_rl.bench.sweep.sweep_summary`, over the runs
    in ``order``, indices of ``specs`` in the order they ran, default as given)."""
    from anchor_rl.bench.plots import plot_suite
    from anchor_rl.bench.summary import (
        amortise,
        class_accuracy,
        paired,
        prompt_accuracy,
        run_figures,
        summarise,
        write_summary,
    )
    from anchor_rl.trainer.logging import read_evals, read_metrics

    records = {spec.run_dir: read_metrics(spec.run_dir) for spec in specs}
    runs = [
        {
            "label": spec.label,
            "seed": spec.seed,
            "dir": str(spec.run_dir),
            "figures": run_figures(records[spec.run_dir], target, metric),
            "anchor_key": _anchor_key(spec.run_dir),
        }
        for spec in specs
    ]
    amortise(runs)
    per_prompt: dict[str, list] = {}
    seeds: dict[str, list[int]] = {}
    evals = {spec.run_dir: read_evals(spec.run_dir) for spec in specs}
    for run, spec in zip(runs, specs, strict=True):
        pair = prompt_accuracy(evals[spec.run_dir])
        per_prompt.setdefault(spec.label, []).extend([pair] if pair else [])
        seeds.setdefault(spec.label, []).extend([spec.seed] if pair else [])
        if pair:
            run["figures"] |= class_accuracy(*pair)
    groups = summarise(runs)
    labels = list(per_prompt)
    if baseline is not None and baseline not in labels:
        raise ConfigError(f"suite {name!r}: baseline {baseline!r} is not among its runs {labels}")
    comparisons = paired(per_prompt, baseline or labels[0], seeds)
    extra, extra_md = None, ""
    if budget is not None:
        from anchor_rl.bench.budget import blocks_markdown, suite_comparison

        runs_data = [{"label": s.label, "seed": s.seed, "records": records[s.run_dir],
                      "evals": evals[s.run_dir]} for s in specs]  # fmt: skip
        from anchor_rl.bench.costs import COSTS_FILE, Costs

        measured = Path(out) / COSTS_FILE  # costs measured on another machine, if given
        costs = Costs.from_dict(json.loads(measured.read_text())) if measured.is_file() else None
        payload, blocks = suite_comparison(runs_data, budget, baseline or labels[0], costs)
        extra, extra_md = {"budget": payload}, blocks_markdown(blocks)
    if sweep:
        from anchor_rl.bench.sweep import sweep_markdown, sweep_summary

        ran = [specs[i] for i in (order if order is not None else range(len(specs)))]
        keys = ("label", "seed", "records", "evals", "reads_anchors", "dir")
        payload = sweep_summary([
            dict(zip(keys, (s.label, s.seed, records[s.run_dir], evals[s.run_dir],
                            _reads_anchors(s.config), s.run_dir), strict=True))
            for s in ran
        ])  # fmt: skip
        extra = {**(extra or {}), "sweep": payload}
        extra_md += ("\n" if extra_md else "") + sweep_markdown(payload)
    json_path, md_path = write_summary(out, name, runs, groups, comparisons, extra, extra_md)
    by_label: dict[str, list] = {}
    for spec in specs:
        by_label.setdefault(spec.label, []).append(records[spec.run_dir])
    common = None if budget is None else budget["rollouts"]
    plots = plot_suite(by_label, out, f"suite {name}", budget=common)
    return {"summary_json": json_path, "summary_md": md_path, "plots": plots}


def _anchor_key(run_dir: Path) -> str | None:
    """The store key of a run's presampled anchors (``pvpo.json``), None for a run without."""
    path = Path(run_dir) / "pvpo.json"
    return json.loads(path.read_text())["key"] if path.is_file() else None


def _merge(base: Mapping[str, Any], layer: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``layer`` merged in, nested tables merged key by key."""
    out = dict(base)
    for key, value in layer.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def command_line(
    suite: str,
    out: Path,
    seeds: Sequence[int] | None,
    steps: int | None,
    overrides: Sequence[str],
    profile: str | None,
) -> str:
    """The ``anchor-rl bench`` command that reproduces a function suite's run."""
    parts = [f"anchor-rl bench {suite}", f"--out {out}"]
    if seeds is not None:
        parts.append("--seeds " + ",".join(map(str, seeds)))
    if steps is not None:
        parts.append(f"--steps {steps}")
    if profile is not None:
        parts.append(f"--profile {profile}")
    parts += list(overrides)
    return " ".join(parts)
