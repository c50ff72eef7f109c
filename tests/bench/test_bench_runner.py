"""Bench runner: suite parsing and planning, a 2-run micro suite end to end, run figures."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import load_script
from typer.testing import CliRunner

from anchor_rl.bench.runner import BenchArgs, load_suite, plan, run_suite
from anchor_rl.bench.summary import (
    amortise,
    class_accuracy,
    first_sustained,
    markdown_table,
    run_figures,
    summarise,
    time_to_accuracy,
)
from anchor_rl.cli import app
from anchor_rl.trainer.config import ConfigError
from anchor_rl.trainer.logging import read_evals, read_metrics
from anchor_rl.trainer.presets import builtin_names

MICRO = """
description = "two presets, one seed"
presets = ["grpo", "rloo"]
seeds = [0]

[base]
task = "arithmetic"
model = "random:tiny"
steps = 2

[base.rollout]
prompts_per_step = 2
n = 2
max_new_tokens = 8

[base.eval]
every = 1
prompts = 2

[base.log]
progress = false
tensorboard = false

[variants.short]
rollout = { max_new_tokens = 4 }

[profiles.longer]
steps = 3
"""


@pytest.fixture
def micro(tmp_path):
    path = tmp_path / "micro.toml"
    path.write_text(MICRO)
    return path


def test_builtin_suites_load_and_every_run_validates(tmp_path) -> None:
    assert "baselines" in builtin_names("anchor_rl.bench", "suites")
    suite = load_suite("baselines")
    assert suite.presets == ["grpo", "drgrpo", "dapo", "rloo", "reinforce_pp"]
    full = plan(suite, tmp_path)
    assert len(full) == 9 * len(suite.seeds)
    assert all(s.config.task == "arithmetic" and s.config.model == "sft:tiny" for s in full)
    # every method but the most expensive (DAPO) has a copy run to the common budget, the
    # same config but for budget.rollouts (a stand-in before "max" is known)
    assert suite.budget == "max" and sorted(suite.to_budget) == sorted(
        f"{p}+budget" for p in ("grpo", "drgrpo", "rloo", "reinforce_pp")
    )
    by = {(s.label, s.seed): s for s in full}
    for label in suite.to_budget:
        copy, cell = by[(label, 0)], by[(label.removesuffix("+budget"), 0)]
        assert copy.to_budget and not cell.to_budget and copy.config.budget.rollouts is not None
        mine, same = copy.config.model_dump(), cell.config.model_dump()
        mine.pop("budget"), same.pop("budget")
        assert mine == same, label
    quick = plan(suite, tmp_path, seeds=[0], profile="quick")
    assert len(quick) == 9 and all(s.config.model == "random:tiny" for s in quick)
    dapo = next(s.config for s in quick if s.label == "dapo")
    assert (
        dapo.filter.kind == "dynamic" and dapo.loss.clip_high == 0.28
    )  # the preset survives the layers


def test_plan_layers_and_directories(micro, tmp_path) -> None:
    specs = plan(
        load_suite(str(micro)),
        tmp_path,
        seeds=[3, 4],
        steps=5,
        overrides=["optim.lr=0.5"],
        profile="longer",
    )
    assert [(s.label, s.seed) for s in specs] == [
        ("grpo+short", 3), ("grpo+short", 4), ("rloo+short", 3), ("rloo+short", 4),
    ]  # fmt: skip
    first = specs[0].config
    assert first.steps == 5  # --steps beats the profile
    assert first.optim.lr == 0.5 and first.rollout.max_new_tokens == 4 and first.rollout.n == 2
    assert first.seed == 3 and first.kl.coef == 0.04  # seed set per run; the preset's KL kept
    assert specs[1].run_dir == tmp_path / "grpo+short" / "seed4"


def test_each_seed_of_a_suite_draws_its_own_anchors_unless_the_suite_sets_them(tmp_path):
    specs = plan(load_suite("pvpo"), tmp_path, profile="quick")
    seeds = {(s.label, s.seed): s.config.pvpo.presample_seed for s in specs}
    assert {seeds[("pvpo+n2", k)] for k in (0, 1, 2)} == {0, 1, 2}  # the run's own seed
    assert {seeds[("grpo+n8", k)] for k in (0, 1, 2)} == {None}  # reads no anchors
    suite = tmp_path / "fixed.toml"
    suite.write_text(
        'presets = ["pvpo"]\nseeds = [0, 1]\n[base]\nmodel = "random:tiny"\n'
        "[per_preset.pvpo]\npvpo = { presample_seed = 7 }\n"
    )
    assert {s.config.pvpo.presample_seed for s in plan(load_suite(str(suite)), tmp_path)} == {7}


def test_runs_may_name_a_bare_preset_beside_its_variants(tmp_path) -> None:
    suite = tmp_path / "s.toml"
    suite.write_text(
        'presets = ["grpo"]\nseeds = [0]\nruns = ["grpo", "grpo+fast"]\n'
        "[variants.fast]\noptim = { lr = 1e-3 }\n"
    )
    specs = plan(load_suite(str(suite)), tmp_path)
    assert [(s.label, s.config.optim.lr) for s in specs] == [("grpo", 3e-5), ("grpo+fast", 1e-3)]
    # a profile's settings for one variant apply after the variant's own
    suite.write_text(
        'presets = ["grpo"]\nseeds = [0]\nruns = ["grpo", "grpo+fast"]\n'
        "[variants.fast]\noptim = { lr = 1e-3 }\nsteps = 400\n"
        "[profiles.quick]\nsteps = 2\n[profiles.quick.variants.fast]\nsteps = 3\n"
    )
    specs = plan(load_suite(str(suite)), tmp_path, profile="quick")
    assert [(s.label, s.config.steps, s.config.optim.lr) for s in specs] == [
        ("grpo", 2, 3e-5), ("grpo+fast", 3, 1e-3),
    ]  # fmt: skip
    assert [s.config.steps for s in plan(load_suite(str(suite)), tmp_path)] == [100, 400]
    suite.write_text(
        'presets = ["grpo"]\nseeds = [0]\n[variants.fast]\nsteps = 4\n'
        "[profiles.quick.variants.slow]\nsteps = 3\n"
    )
    with pytest.raises(ConfigError, match=r"profile 'quick': no variants \['slow'\]"):
        plan(load_suite(str(suite)), tmp_path, profile="quick")
    suite.write_text('presets = ["grpo"]\nseeds = [0]\n[variants.fast]\noptim = { lr = 1e-3 }\n')
    assert [s.label for s in plan(load_suite(str(suite)), tmp_path)] == ["grpo+fast"]


def test_plan_fails_before_any_run_naming_the_run_and_field(micro, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"(?s)run grpo\+short seed 0: .*rollout\.n:"):
        plan(load_suite(str(micro)), tmp_path, overrides=["rollout.n=0"])
    with pytest.raises(ConfigError, match="no profile 'fast'"):
        plan(load_suite(str(micro)), tmp_path, profile="fast")
    bad = tmp_path / "bad.toml"
    bad.write_text('presets = ["grpo"]\nseed = [1]\n')
    with pytest.raises(ConfigError, match="unknown keys"):
        load_suite(str(bad))
    with pytest.raises(ConfigError, match="baselines"):
        load_suite("no-such-suite")


@pytest.mark.slow
def test_micro_suite_end_to_end(micro, tmp_path) -> None:
    out = tmp_path / "out"
    suite = load_suite(str(micro))
    result = run_suite(suite, BenchArgs(out, echo=lambda _: None))
    summary = json.loads(result["summary_json"].read_text())
    assert [g["label"] for g in summary["groups"]] == ["grpo+short", "rloo+short"]
    assert {r["label"] for r in summary["runs"]} == {"grpo+short", "rloo+short"}
    figures = summary["groups"][0]["figures"]
    assert figures["rollouts"]["mean"] == 8  # 2 steps x 2 prompts x 2 responses
    assert figures["eval_final"]["n"] == 1 and figures["eval_final"]["half_width"] is None
    table = result["summary_md"].read_text()
    assert "| grpo+short | 1 |" in table and "| rloo+short | 1 |" in table
    # paired over the held-out prompts both evaluated, against the first label
    paired = summary["paired"]
    assert paired["baseline"] == "grpo+short" and set(paired["gain"]) == {
        "grpo+short",
        "rloo+short",
    }
    gain = paired["gain"]["grpo+short"]
    assert gain["prompts"] == 2  # eval.prompts of the micro suite
    assert gain["mean"] == pytest.approx(figures["eval_gain"]["mean"])  # one seed: the same gain
    assert set(paired["vs_baseline"]) == {"rloo+short"} and "## Over held-out prompts" in table
    assert sorted(p.name for p in result["plots"]) == [
        "accuracy_vs_rollouts.png", "accuracy_vs_steps.png", "accuracy_vs_time.png",
    ]  # fmt: skip
    assert all(p.stat().st_size > 1000 for p in result["plots"])
    # re-running the same command skips finished runs
    metrics = out / "grpo+short" / "seed0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    run_suite(suite, BenchArgs(out, echo=lambda _: None))
    assert metrics.stat().st_mtime_ns == before
    # ... also a run whose config predates a field added since (it reads as the default)
    config = out / "grpo+short" / "seed0" / "config.json"
    stored = json.loads(config.read_text())
    del stored["pvpo"]["prompts"]
    config.write_text(json.dumps(stored))
    run_suite(suite, BenchArgs(out, echo=lambda _: None))
    assert metrics.stat().st_mtime_ns == before
    # the compact copy (scripts/compact_results.py) keeps what the paired table reads
    compact = load_script("compact_results")
    dest = tmp_path / "compact"
    compact.main(out, dest)
    run, copy = out / "grpo+short" / "seed0", dest / "grpo+short" / "seed0"
    assert sorted(p.name for p in copy.iterdir()) == [
        "config.json",
        "evals.jsonl.gz",
        "metrics.jsonl.gz",
        "summary.json",
    ]
    full = read_evals(run)
    assert read_evals(copy) == [{"step": e["step"], "test": e["test"]} for e in full]
    assert [r["step"] for r in read_metrics(copy)] == [r["step"] for r in read_metrics(run)]
    again = tmp_path / "compact-again"  # the same suite compacts to the same bytes
    compact.main(out, again)
    assert (again / "grpo+short" / "seed0" / "metrics.jsonl.gz").read_bytes() == (
        copy / "metrics.jsonl.gz"
    ).read_bytes()
    assert (dest / "summary.json").is_file()
    # ... and a suite re-run over compact results skips their finished runs (no checkpoints),
    # refusing only to extend one it cannot resume
    kept = copy / "metrics.jsonl.gz"
    before_copy = kept.stat().st_mtime_ns
    run_suite(suite, BenchArgs(dest, echo=lambda _: None))
    assert kept.stat().st_mtime_ns == before_copy
    with pytest.raises(ConfigError, match="without a checkpoint"):
        run_suite(suite, BenchArgs(dest, steps=3, echo=lambda _: None))
    # ... and a different config in the same directory is refused, not silently reused
    with pytest.raises(ConfigError, match="different config"):
        run_suite(suite, BenchArgs(out, overrides=["optim.lr=0.5"], echo=lambda _: None))


@pytest.mark.slow
def test_bench_cli(micro, tmp_path) -> None:
    out = tmp_path / "cli"
    result = CliRunner().invoke(
        app, ["bench", str(micro), "--seeds", "0,1", "--steps", "1", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert [len(g["seeds"]) for g in groups] == [2, 2]
    assert groups[0]["figures"]["rollouts"]["half_width"] == 0.0  # same count for both seeds
    bad = CliRunner().invoke(app, ["bench", str(micro), "--seeds", "a,b", "--out", str(out)])
    assert bad.exit_code == 2 and "--seeds" in bad.output


@pytest.mark.slow
def test_bench_cli_runs_picks_cells_of_the_suite(micro, tmp_path) -> None:
    out = tmp_path / "one"
    # the micro suite has variants, so without --runs the bare presets would not run
    args = ["bench", str(micro), "--runs", "rloo", "--steps", "1", "--out", str(out)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    groups = json.loads((out / "summary.json").read_text())["groups"]
    assert [g["label"] for g in groups] == ["rloo"]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["rloo"]
    unknown = CliRunner().invoke(app, ["bench", str(micro), "--runs", "ppo", "--out", str(out)])
    assert unknown.exit_code == 2, unknown.output
    assert "['ppo']" in unknown.output and "rloo+short" in unknown.output
    for bad in (["bench", str(micro), "--runs", " , "], ["bench", "trl", "--runs", "grpo"]):
        result = CliRunner().invoke(app, [*bad, "--out", str(out)])
        assert result.exit_code == 2 and "--runs" in result.output, result.output


def _records(accs, rewards, seconds):
    records = [{"step": 0, "eval/accuracy": accs[0], "rollouts/cumulative": 0, "time/elapsed": 1.0}]
    for i, (r, s) in enumerate(zip(rewards, seconds, strict=True), 1):
        records.append({
            "step": i, "reward/mean": r, "rollouts/cumulative": 4.0 * i, "tokens/cumulative": 10.0 * i,
            "time/elapsed": 1.0 + i, "time/generate": s, "time/score": 0.1, "time/update": 0.5,
        })  # fmt: skip
    records[-1]["eval/accuracy"] = accs[1]
    return records


def test_run_figures_by_hand() -> None:
    records = _records((0.25, 0.5), [0.0, 0.2, 0.4, 0.6, 0.8], [1.0, 2.0, 3.0, 4.0, 5.0])
    f = run_figures(records)
    assert f["eval_start"] == 0.25 and f["eval_final"] == 0.5 and f["eval_best"] == 0.5
    assert f["reward_last"] == 0.8  # last fifth of 5 steps: step 5 only
    assert (f["rollouts"], f["tokens"], f["wall_s"]) == (20.0, 50.0, 6.0)
    assert f["generate_s"] == 3.0 and f["score_s"] == pytest.approx(0.1)
    assert f["policy_rollouts"] == 20.0 and f["presample_rollouts"] == 0.0
    assert "v05_weight_nonzero" not in f
    # a PVPO / V0.5 run: the per-run total has the presampling, the policy's count does not
    for i, r in enumerate(records[1:], 1):
        r |= {"rollouts/presample": 64.0, "rollouts/total": 64.0 + 4.0 * i}
        r["v05/weight_zero_frac"] = 0.25 if i % 2 else 0.75
    f = run_figures(records)
    assert (f["policy_rollouts"], f["rollouts"], f["presample_rollouts"]) == (20.0, 84.0, 64.0)
    assert f["v05_weight_nonzero"] == pytest.approx(1 - (3 * 0.25 + 2 * 0.75) / 5)


def test_class_accuracy_splits_the_gain_into_fixes_and_keeps() -> None:
    start = {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.5, "e": 1.0}
    final = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 1.0, "e": 1.0}
    assert class_accuracy(start, final) == {"eval_fixed": 0.5, "eval_kept": 0.5}
    assert class_accuracy({"a": 0.5}, {"a": 1.0}) == {}


def test_amortise_splits_the_presampling_over_the_runs_sharing_the_anchors() -> None:
    def run(key, presample, total):
        return {"anchor_key": key, "figures": {"rollouts": total, "presample_rollouts": presample}}

    runs = [run("a", 4096.0, 5696.0), run("a", 4096.0, 5696.0), run("b", 4096.0, 9792.0),
            run(None, 0.0, 6400.0)]  # fmt: skip
    amortise(runs)
    assert [r["figures"]["amortised_rollouts"] for r in runs] == [
        1600.0 + 2048.0,
        1600.0 + 2048.0,
        9792.0,
        6400.0,
    ]


def test_a_target_counts_only_where_the_curve_stays_at_or_above_it() -> None:
    assert first_sustained([0.1, 0.6, 0.4, 0.55, 0.7], 0.5) == 3  # the hit at 1 was noise
    assert first_sustained([0.1, 0.6, 0.4], 0.5) is None
    assert first_sustained([0.5, 0.5], 0.5) == 0
    records = [
        {"eval/accuracy": acc, "time/elapsed": float(t), "rollouts/cumulative": 10.0 * t}
        for t, acc in enumerate([0.1, 0.6, 0.4, 0.55, 0.7])
    ]
    records.insert(2, {"time/elapsed": 1.5, "rollouts/cumulative": 15.0})  # no evaluation
    hit = time_to_accuracy(records, 0.5)
    assert hit == {"target_reached": 1.0, "target_wall_s": 3.0, "target_rollouts": 30.0}
    assert time_to_accuracy(records[:4], 0.5) == {"target_reached": 0.0}


def test_summarise_and_markdown_by_hand() -> None:
    runs = [
        {"label": "grpo", "seed": s, "figures": {"eval_final": acc, "rollouts": 20.0}}
        for s, acc in [(0, 0.4), (1, 0.5), (2, 0.6)]
    ]
    (group,) = summarise(runs)
    final = group["figures"]["eval_final"]
    # mean 0.5, s = 0.1, t_{.975,2} = 4.3027: half-width 4.3027 * 0.1 / sqrt(3) = 0.2484
    assert final["mean"] == pytest.approx(0.5) and final["half_width"] == pytest.approx(
        0.2484, abs=1e-4
    )
    assert final["values"] == [0.4, 0.5, 0.6]
    table = markdown_table("s", [group])
    assert "| grpo | 3 | – | 0.500 ± 0.248 |" in table


def test_testbed_sampled_differs_from_testbed_only_in_how_it_evaluates(tmp_path) -> None:
    sampled = {(s.label, s.seed): s.config for s in plan(load_suite("testbed-sampled"), tmp_path)}
    greedy = {(s.label, s.seed): s.config for s in plan(load_suite("testbed"), tmp_path / "g")}
    assert sorted({label for label, _ in sampled}) == ["grpo", "grpo+lr1e4", "grpo+steps400"]
    for key, config in sampled.items():
        assert (config.eval.k, config.eval.temperature, config.eval.prompts) == (4, 1.0, 1000)
        same = greedy[key].model_dump()
        mine = config.model_dump()
        for name in ("k", "temperature"):
            same["eval"].pop(name), mine["eval"].pop(name)
        assert mine == same, key
    # the testbed's 100-step variants have copies run to grpo+steps400's budget
    testbed = load_suite("testbed")
    assert testbed.budget == "max" and "grpo+steps400" not in testbed.to_budget
    for label, seed in greedy:
        if label in testbed.to_budget:
            mine = greedy[(label, seed)].model_dump()
            same = greedy[(label.removesuffix("_budget"), seed)].model_dump()
            for name in ("budget", "eval", "checkpoint"):  # the copies evaluate every 50 steps
                mine.pop(name), same.pop(name)
            assert mine == same, label
    assert {label for label, _ in greedy} - {label for label, _ in sampled} >= set(
        testbed.to_budget
    )


BUDGET_SUITE = """
description = "a cheap cell run to the budget of an expensive one"
presets = ["grpo"]
seeds = [0]
runs = ["grpo+big", "grpo+small"]
budget = "max"
to_budget = ["grpo+small"]

[base]
task = "arithmetic"
model = "random:tiny"
steps = 2

[base.rollout]
prompts_per_step = 2
max_new_tokens = 8

[base.eval]
every = 1
prompts = 3

[base.log]
progress = false
tensorboard = false

[variants.big]
rollout = { n = 4 }

[variants.small]
rollout = { n = 2 }
"""


def test_a_suite_runs_cheap_cells_to_the_budget_of_the_most_expensive(tmp_path) -> None:
    path = tmp_path / "budget.toml"
    path.write_text(BUDGET_SUITE)
    suite = load_suite(str(path))
    out = tmp_path / "out"
    result = run_suite(suite, BenchArgs(out, echo=lambda _: None))
    summary = json.loads(result["summary_json"].read_text())
    # grpo+big: 2 steps x 2 prompts x 4 = 16 rollouts, the budget; grpo+small: 4 per step
    assert summary["budget"]["rollouts"] == 16 and summary["budget"]["to_budget"] == ["grpo+small"]
    small = read_metrics(out / "grpo+small" / "seed0")
    assert [r["step"] for r in small][-1] == 4 and small[-1]["rollouts/total"] == 16
    assert json.loads((out / "grpo+small" / "seed0" / "summary.json").read_text())["stop"] == (
        "budget"
    )
    at = summary["budget"]["at_equal"]
    assert set(at) == {"rollouts", "wall_seconds", "modelled_seconds"}
    cells = at["rollouts"]["labels"]
    for label in ("grpo+big", "grpo+small"):
        assert cells[label]["at"]["1.0"]["reached"] == 1 and cells[label]["area"] is not None
    # at 25% (4 rollouts) grpo+small is read after step 1; grpo+big at its first step (8)
    assert cells["grpo+small"]["at"]["0.25"]["rollouts"] == 4
    assert cells["grpo+big"]["at"]["0.25"]["rollouts"] == 8
    assert "grpo+small" in at["rollouts"]["vs_baseline"]
    assert set(summary["budget"]["costs"]) == {
        "generate_per_token", "score_per_rollout", "forward_per_token", "sync_per_step",
    }  # fmt: skip
    text = result["summary_md"].read_text()
    assert "## At equal budget" in text and "### At equal modelled seconds" in text
    # anchor-rl report reads the budget back and compares from the raw results
    from anchor_rl.bench.report import write_report

    page = write_report([out], tmp_path / "report")["md"].read_text()
    assert "At equal budget" in page and "At equal rollouts (16)" in page
    assert "held-out (final)" in page and "vs baseline, prompt-only" in page
    # re-running skips both finished runs, the one stopped by its budget too
    metrics = out / "grpo+small" / "seed0" / "metrics.jsonl"
    before = metrics.stat().st_mtime_ns
    run_suite(suite, BenchArgs(out, echo=lambda _: None))
    assert metrics.stat().st_mtime_ns == before
    # costs measured elsewhere (python -m anchor_rl.bench.costs RUN... --out OUT/costs.json)
    # replace the fitted ones
    from anchor_rl.bench.costs import main as fit_main

    fit_main([str(out / "grpo+big" / "seed0"), "--out", str(out / "costs.json")])
    given = json.loads((out / "costs.json").read_text())
    assert given != summary["budget"]["costs"]  # one run's costs, not the suite's
    result = run_suite(suite, BenchArgs(out, echo=lambda _: None))
    assert json.loads(result["summary_json"].read_text())["budget"]["costs"] == given
    assert "costs given (costs.json)" in result["summary_md"].read_text()
    # a different common budget is refused for the finished run, not silently reused
    with pytest.raises(ConfigError, match="asks 20"):
        run_suite(dataclasses.replace(suite, budget=20), BenchArgs(out, echo=lambda _: None))


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ('budget = "max"\nto_budget = []', "to_budget names no cell"),
        ('to_budget = ["grpo+small"]', "needs budget"),
        ('budget = -3\nto_budget = ["grpo+small"]', "positive number"),
        ('budget = "max"\nto_budget = ["grpo+big", "grpo+small"]', "needs a run not in"),
        ('budget = 10\nto_budget = ["grpo+nope"]', "not among its runs"),
    ],
)
def test_suite_budget_settings_refuse_nonsense(tmp_path, extra, match) -> None:
    text = BUDGET_SUITE.replace('budget = "max"\nto_budget = ["grpo+small"]\n', extra + "\n")
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        plan(load_suite(str(path)), tmp_path / "o")
