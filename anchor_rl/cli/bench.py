"""``anchor-rl bench SUITE`` (run a suite's presets x variants x seeds and report),
``anchor-rl report RUNS...`` (one report from results) and ``anchor-rl quickstart``.

torch and transformers are imported inside the commands, so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import time
from pathlib import Path
from typing import Annotated

import typer

from anchor_rl.errors import ConfigError
from anchor_rl.trainer.presets import builtin_names

FUNCTION_SUITES = {
    "trl": "anchor_rl.bench.trl_compare:run_trl_suite",
    "throughput": "anchor_rl.bench.throughput:run_throughput_suite",
    "baseline-mse": "anchor_rl.bench.probe:run_baseline_mse_suite",
    "trl-pvpo": "anchor_rl.bench.trl_pvpo:run_trl_pvpo_suite",
}
"""Suites that are a function, not a suite file: ``fn(BenchArgs) -> {"summary_json",
"summary_md", "plots"}`` (the signature of ``run_suite`` after the suite)."""

_BUILTIN_SUITES = sorted({*builtin_names("anchor_rl.bench", "suites"), *FUNCTION_SUITES})


def bench(
    suite: Annotated[
        str,
        typer.Argument(
            help=f"A built-in suite name ({', '.join(_BUILTIN_SUITES)}) or a suite TOML path."
        ),
    ],
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Config overrides for every run, key=value with dotted keys."),
    ] = None,
    seeds: Annotated[
        str | None, typer.Option("--seeds", help="Comma-separated seeds (default: the suite's).")
    ] = None,
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="Output directory (default: bench/<suite>).")
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", help="Training steps of every run.")
    ] = None,
    profile: Annotated[
        str | None, typer.Option("--profile", help="A profile of the suite file (e.g. quick).")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Same as --profile quick: a CI-sized smoke run.")
    ] = False,
    device: Annotated[
        str | None, typer.Option("--device", help="Torch device of every run (cpu, cuda).")
    ] = None,
    runs: Annotated[
        str | None,
        typer.Option(
            "--runs",
            help="Comma-separated run labels to run, e.g. grpo+n8 (default: the suite's).",
        ),
    ] = None,
    budget: Annotated[
        str | None,
        typer.Option("--budget", help="Common rollout budget: max or N (default: the suite's)."),
    ] = None,
    to_budget: Annotated[
        str | None,
        typer.Option("--to-budget", help="Comma-separated labels run to --budget, not to steps."),
    ] = None,
    shared_anchors: Annotated[
        bool | None,
        typer.Option(
            "--shared-anchors/--own-anchors",
            help="A sweep: every run that reads anchors shares one store and one anchor draw, "
            "and the summary adds the sweep's cost per run and break-even k (default: the "
            "suite's shared_anchors).",
        ),
    ] = None,
) -> None:
    """Run a benchmark suite; writes summary.json, summary.md and accuracy plots.

    Re-running the same command skips finished runs and resumes stopped ones.
    """
    from anchor_rl.bench.runner import BenchArgs, load_suite, run_suite

    if quick and profile not in (None, "quick"):
        raise ConfigError("--quick and --profile name different profiles")
    seed_list = _parse_seeds(seeds) if seeds is not None else None
    settings = [*(overrides or []), *([f"device={device}"] if device else [])]
    if suite in FUNCTION_SUITES:
        if runs is not None or shared_anchors is not None:
            flag = "--runs" if runs is not None else "--shared-anchors/--own-anchors"
            raise ConfigError(f"{flag} applies to a suite file; suite {suite!r} is a function")
        module, _, name = FUNCTION_SUITES[suite].partition(":")
        run, target = getattr(importlib.import_module(module), name), suite
    else:
        loaded = load_suite(suite, others=list(FUNCTION_SUITES))
        if runs is not None:  # plan() rejects a label the suite does not have
            labels = [r.strip() for r in runs.split(",") if r.strip()]
            if not labels:
                raise ConfigError(f"--runs names no run: {runs!r}")
            loaded = dataclasses.replace(loaded, runs=labels)
        if budget is not None or to_budget is not None:  # plan() checks them with the suite
            from anchor_rl.bench.runner import budget_options

            loaded = budget_options(loaded, budget, to_budget)
        if shared_anchors is not None:
            loaded = dataclasses.replace(loaded, shared_anchors=shared_anchors)
        run, target = functools.partial(run_suite, loaded), loaded.name
    args = BenchArgs(
        out or Path("bench") / target, seeds=seed_list, steps=steps, overrides=settings,
        profile="quick" if quick else profile, echo=typer.echo,
    )  # fmt: skip
    result = run(args)
    typer.echo(result["summary_md"].read_text())
    typer.echo(f"summary: {result['summary_json']}, plots: {', '.join(map(str, result['plots']))}")


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError(f"--seeds must be comma-separated integers, got {text!r}") from None
    if not seeds:
        raise ConfigError("--seeds is empty")
    return seeds


def report_command(
    runs: Annotated[
        list[Path],
        typer.Argument(help="Training runs or bench result directories (searched recursively)."),
    ],
    out: Annotated[
        Path, typer.Option("--out", "-o", help="Directory for report.md, report.html and plots.")
    ] = Path("report"),
    results_md: Annotated[
        Path | None,
        typer.Option(
            "--results-md",
            help="Also write the report between the generated-block markers of this markdown file.",
        ),
    ] = None,
    readme: Annotated[
        Path | None,
        typer.Option(
            "--readme",
            help="Rewrite this file's <!-- results:start/end --> block: the budget suite's "
            "short equal-budget table.",
        ),
    ] = None,
    results_page: Annotated[
        Path | None,
        typer.Option(
            "--results-page",
            help="Rewrite this file's <!-- equal-budget-table:start/end --> block: the budget "
            "suite's full equal-budget tables.",
        ),
    ] = None,
    budget_suite: Annotated[
        str, typer.Option("--budget-suite", help="The suite --readme and --results-page read.")
    ] = "pvpo_budget",
    budget_baseline: Annotated[
        str,
        typer.Option("--budget-baseline", help="The label --results-page's differences subtract."),
    ] = "grpo+n2",
) -> None:
    """Build one report (markdown + offline HTML) from training runs and bench results."""
    command = " ".join(
        ["anchor-rl report", *map(str, runs), f"--out {out}"]
        + ([f"--results-md {results_md}"] if results_md else [])
    )
    from anchor_rl.bench import headline
    from anchor_rl.bench.report import write_report
    from anchor_rl.bench.results import load_results

    try:
        headline.check_blocks(readme, results_page)  # before the report's minutes of work
        paths = write_report(runs, out, results_md, command)
        if readme or results_page:
            written = headline.write_blocks(
                load_results(runs), readme, results_page, budget_suite, budget_baseline
            )
            paths |= {str(p): p for p in written}
    except (FileNotFoundError, ValueError) as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None
    typer.echo("wrote " + ", ".join(str(p) for p in paths.values()))


def quickstart(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(help="Config overrides for the run, key=value with dotted keys."),
    ] = None,
    task: Annotated[
        str, typer.Option("--task", help="Task: arithmetic, countdown or multihop.")
    ] = "arithmetic",
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o", help="Run and report directory (default: runs/quickstart-TASK-TIME)."
        ),
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", min=1, help="Training steps (default 60).")
    ] = None,
    time_limit: Annotated[
        float | None,
        typer.Option("--time-limit", min=1.0, help="Stop training after this many seconds."),
    ] = None,
    compare: Annotated[
        bool,
        typer.Option(
            "--compare/--no-compare",
            help="Also train GRPO at the same settings and compare on held-out prompts.",
        ),
    ] = True,
) -> None:
    """PVPO end to end: SFT reference (cached), presampling, group sampling, training with
    held-out evaluation before and after, GRPO at the same settings beside it, its raw
    results (OUT/quickstart.json, read by anchor-rl report) and a report (markdown, PNG)."""
    from anchor_rl.bench.quickstart import quickstart_config, run_quickstart
    from anchor_rl.bench.quickstart_results import CAVEAT, RUNS, accuracy_line, verdict
    from anchor_rl.bench.summary import format_bootstrap

    cfg = quickstart_config(task, steps, time_limit, overrides or [])
    run_dir = out or Path("runs") / f"quickstart-{task}-{time.strftime('%Y%m%d-%H%M%S')}"
    command = " ".join(  # recorded in the raw results: no machine path
        ["anchor-rl quickstart", *([f"--task {task}"] if task != "arithmetic" else []),
         *([f"--steps {steps}"] if steps is not None else []),
         *([f"--time-limit {time_limit:g}"] if time_limit is not None else []),
         *([] if compare else ["--no-compare"]), *(overrides or [])]
    )  # fmt: skip
    result = run_quickstart(cfg, run_dir, compare, command)
    raw = result["raw"]
    for name in RUNS:
        if name in raw["runs"]:
            typer.echo(accuracy_line(raw, name, arrow="->"))
    if "pvpo_minus_grpo" in raw:
        d = raw["pvpo_minus_grpo"]
        typer.echo(
            f"PVPO minus GRPO after training {format_bootstrap(d)} (95% paired bootstrap over "
            f"prompts): {verdict(d)}"
        )
    typer.echo(f"{CAVEAT[0].upper()}{CAVEAT[1:]}; docs/quickstart.md has two CPUs' figures.")
    typer.echo(
        f"quickstart took {result['total_s']:.0f} s; report: {result['report_md']} (plot: "
        f"{result['report_png']}; raw results: {result['raw_json']})"
    )
