"""`anchor-rl report`: a report from a synthetic bench directory (markdown, offline HTML,
plots), the headline claims measured by hand, and the generated block of results.md."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from anchor_rl.bench import quickstart_results
from anchor_rl.bench.claims import CLAIMS, measure_claim
from anchor_rl.bench.report import BEGIN, END, splice
from anchor_rl.bench.results import load_results
from anchor_rl.bench.summary import run_figures, summarise, write_summary
from anchor_rl.bench.throughput import stage_figures
from anchor_rl.bench.trl_report import DIFFERENCES, ratios
from anchor_rl.bench.trl_report import summarise as trl_summarise
from anchor_rl.cli import app

# Held-out accuracy at steps 0, 2, 4 for two seeds of each label.
ACCURACY = {
    "grpo": ([0.2, 0.4, 0.5], [0.2, 0.4, 0.7]),  # final mean 0.6
    "dapo": ([0.2, 0.5, 0.6], [0.2, 0.5, 0.8]),  # final mean 0.7
    "grpo+n8": ([0.2, 0.4, 0.5], [0.2, 0.4, 0.7]),  # final mean 0.6
    "pvpo+n2": ([0.2, 0.65, 0.7], [0.2, 0.65, 0.7]),  # passes 0.6 at step 2
}


def _records(accuracy: list[float]) -> list[dict[str, float]]:
    records = [{"step": 0, "eval/accuracy": accuracy[0], "eval/train_accuracy": accuracy[0] + 0.1,
                "rollouts/cumulative": 0.0, "rollouts/total": 0.0, "tokens/cumulative": 0.0,
                "time/elapsed": 1.0}]  # fmt: skip
    for step in range(1, 5):
        record = {
            "step": step, "reward/mean": 0.1 * step, "rollouts/cumulative": 64.0 * step,
            "rollouts/total": 64.0 * step,
            "tokens/cumulative": 2000.0 * step, "time/elapsed": 1.0 + 2 * step,
            "time/generate": 1.0, "time/score": 0.1, "time/update": 0.8, "time/step": 2.0,
            "advantage/std": 0.9 - 0.1 * step, "policy/entropy": 1.5 - 0.1 * step,
            "kl/ref": 0.01 * step, "tokens/step": 2000.0,
        }  # fmt: skip
        if step % 2 == 0:
            record["eval/accuracy"] = accuracy[step // 2]
            record["eval/train_accuracy"] = accuracy[step // 2] + 0.1
        records.append(record)
    return records


def _write_suite(root, accuracy_by_label=ACCURACY) -> None:
    runs = []
    for label, seeds in accuracy_by_label.items():
        for seed, accuracy in enumerate(seeds):
            run_dir = root / label / f"seed{seed}"
            run_dir.mkdir(parents=True)
            records = _records(accuracy)
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (run_dir / "config.json").write_text(json.dumps({"task": "arithmetic", "seed": seed}))
            (run_dir / "summary.json").write_text(json.dumps({"preset": label, "steps": 4}))
            runs.append({"label": label, "seed": seed, "dir": str(run_dir),
                         "figures": run_figures(records)})  # fmt: skip
    write_summary(root, "synthetic", runs, summarise(runs))


def _write_png(path) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1, 1))
    fig.subplots().plot([0, 1], [0, 1])
    fig.savefig(path)


def _write_mse(root) -> None:
    root.mkdir()
    summary = {
        "group_mean_k4": {"mse_mean": [0.25, 0.25], "rollouts": [4.0, 4.0]},
        "v05_k4": {"mse_mean": [0.05, 0.15], "rollouts": [4.0, 4.0]},
        "group_mean_k16": {"mse_mean": [0.0625, 0.0625], "rollouts": [16.0, 16.0]},
        "v05_adaptive": {"mse_mean": [0.01, 0.1], "rollouts": [5.5, 9.0]},
    }
    block = {"config": {"biases": [0.0, 0.2], "trials": 100}, "summary": summary}
    payload = {"suite": "baseline-mse", "quick": False, "configs": {"pm1_worst": block}}
    (root / "baseline_mse.json").write_text(json.dumps(payload))
    _write_png(root / "mse_vs_rollouts_pm1_worst.png")


def _write_trl(root) -> None:
    root.mkdir()

    def result(seconds, rss, final):
        return {
            "steps": [{"seconds": seconds, "tokens": 100.0, "reward": 0.5}],
            "memory": {"rss_before_mb": 300.0, "rss_peak_mb": rss, "cuda_peak_mb": None},
            "eval": {"start": {"eval/accuracy": 0.2}, "final": {"eval/accuracy": final}},
        }

    summary = trl_summarise(
        {"anchor-rl": [result(2.0, 400.0, 0.5)], "trl": [result(3.0, 600.0, 0.4)]}
    )
    payload = {
        "suite": "trl", "command": "anchor-rl bench trl --out x", "trl_version": "9.9.9",
        "host": {"device": "cpu", "device_name": "test cpu", "torch_threads": 1},
        "seeds": [0], "summary": summary, "ratios": ratios(summary),
        "differences": [list(d) for d in DIFFERENCES],
        "settings": {"preset": "grpo", "task": "arithmetic", "model": "sft:tiny", "steps": 1,
                     "prompts_per_step": 8, "group_size": 8},
    }  # fmt: skip
    (root / "trl_compare.json").write_text(json.dumps(payload))
    _write_png(root / "reward_vs_step.png")


def _write_throughput(root) -> None:
    root.mkdir()
    records = [{"step": 1, "tokens/step": 100.0, "time/generate": 1.0, "time/score": 0.5,
                "time/update": 0.25, "time/step": 2.0}]  # fmt: skip
    payload = {
        "suite": "throughput", "command": "anchor-rl bench throughput --out y",
        "host": {"device": "cpu", "device_name": "test cpu", "torch_threads": 1},
        "settings": {"preset": "grpo", "prompts_per_step": 8, "n": 8, "max_new_tokens": 80,
                     "steps": 1, "warmup_steps_excluded": 0},
        "rows": [{"size": "tiny", "parameters": 1_100_000, "figures": stage_figures(records)}],
    }  # fmt: skip
    (root / "throughput.json").write_text(json.dumps(payload))


@pytest.fixture
def bench(tmp_path):
    root = tmp_path / "runs"
    _write_suite(root / "synthetic")
    _write_mse(root / "baseline-mse")
    _write_trl(root / "trl")
    _write_throughput(root / "throughput")
    return root


def test_claims_measured_by_hand(bench) -> None:
    results = load_results([bench])
    assert sorted(m.label for m in results.methods) == ["dapo", "grpo", "grpo+n8", "pvpo+n2"]
    assert len(results.sources) == 4  # the run-level summary.json files are not suites
    by = {(c.measure, c.method, c.baseline): c for c in CLAIMS}
    (dapo,) = measure_claim(by[("final_gain", "dapo", "grpo")], results)
    assert dapo.startswith(  # t(0.975, 1) = 12.706
        "held-out 0.600 ± 1.271 → 0.700 ± 1.271 (+0.100); "
        "training prompts 0.700 ± 1.271 → 0.800 ± 1.271 (+0.100); rollouts 1.00×"
    )
    assert "suite `synthetic`" in dapo and "2 seed(s)" in dapo
    (speed,) = measure_claim(by[("steps_to_match", "pvpo+n2", "grpo+n8")], results)
    assert speed.startswith(  # held-out, the primary metric
        "held-out accuracy: target 0.600 reached at step 2 of 4 and held to the end (0.50×)"
    )
    assert measure_claim(by[("final_gain", "v05+k4", "grpo+k16")], results) == []
    (mse,) = measure_claim(by[("mse", "v05_k4", "group_mean_k4")], results)
    assert mse.startswith("group_mean_k4: MSE 0.250/0.250, rollouts 4; v05_k4: MSE 0.050/0.150")


def test_a_near_miss_is_not_printed_as_the_target(tmp_path) -> None:
    # pvpo+n2 ends 0.0004 below grpo+n8's final mean: three digits would print both as 0.600
    root = tmp_path / "runs"
    _write_suite(root / "near", {"grpo+n8": ACCURACY["grpo+n8"],
                                 "pvpo+n2": ([0.2, 0.5, 0.5996], [0.2, 0.5, 0.5996])})  # fmt: skip
    by = {(c.measure, c.method, c.baseline): c for c in CLAIMS}
    (speed,) = measure_claim(by[("steps_to_match", "pvpo+n2", "grpo+n8")], load_results([root]))
    assert speed.startswith("held-out accuracy: not reached and held, best 0.5996 vs target 0.6000")


def test_suite_plots_are_named_after_their_directories(bench, tmp_path) -> None:
    """Adding a result renames no other plot; two results of a kind in directories of the
    same name are told apart by their parents."""
    _write_trl(bench / "gpu")  # a second trl result ...
    (bench / "gpu").rename(bench / "gpu-box")
    (bench / "gpu-box" / "trl").mkdir()  # ... in a directory named trl, like the first
    for name in ("trl_compare.json", "reward_vs_step.png"):
        (bench / "gpu-box" / name).rename(bench / "gpu-box" / "trl" / name)
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(bench), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    for png in ("trl_reward_vs_step_runs_trl", "trl_reward_vs_step_gpu-box_trl"):
        assert (out / f"{png}.png").is_file() and f"]({png}.png)" in md
    assert not list(out.glob("trl_reward_vs_step_trl*.png"))
    # and so are their sections
    assert "### `runs/trl`: `sft:tiny`" in md and "### `gpu-box/trl`: `sft:tiny`" in md


def test_a_partial_trl_comparison_says_so_in_the_report(bench, tmp_path) -> None:
    path = bench / "trl" / "trl_compare.json"
    payload = json.loads(path.read_text())
    payload |= {"seeds_planned": [0, 1], "unpaired": ["anchor-rl seed 1"], "note": "A note."}
    path.write_text(json.dumps(payload))
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(bench), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "A note.\n\n**Partial**: 1 of the 2 planned seeds (0, 1)" in md
    assert "left out for want of their pair: anchor-rl seed 1." in md


def test_report_files_and_offline_html(bench, tmp_path) -> None:
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(bench), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    page = (out / "report.html").read_text()
    for png in ("accuracy_vs_rollouts", "accuracy_vs_time", "train_accuracy_vs_rollouts",
                "train_accuracy_vs_time", "advantage_std", "entropy", "kl",
                # a suite's own plot is named after its directory
                "baseline_mse_vs_rollouts_baseline-mse", "trl_reward_vs_step_trl"):  # fmt: skip
        assert (out / f"{png}.png").stat().st_size > 0
        assert f"]({png}.png)" in md
    assert "not measured" in md and "| `v05+k4` vs `grpo+k16` |" in md
    row = "| dapo | synthetic | 2 | 0.200 ± 0.000 | 0.700 ± 1.271 | 0.300 ± 0.000 | 0.800 ± 1.271 |"
    assert f"{row} 256 ± 0 |" in md
    assert (
        "| tiny | 1 process | 1.1M | 100 | 400 | 2.00 | 50.0% | 25.0% | 12.5% | 0.0% | 12.5% |"
        in md
    )
    assert "| seconds per step (mean over steps) | 2.00 | 3.00 | 1.50× |" in md
    # Offline: every image is a data URI, nothing is fetched from anywhere.
    sources = re.findall(r'src="([^"]*)"', page)
    assert len(sources) == md.count("![") == 9
    assert all(s.startswith("data:image/png;base64,") for s in sources)
    assert "http://" not in page and "https://" not in page
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert "<code>anchor-rl bench trl --out x</code>" in page


def test_results_md_block_is_replaced_and_hand_sections_kept(bench, tmp_path) -> None:
    results_md = tmp_path / "docs" / "results.md"
    results_md.parent.mkdir()
    results_md.write_text(
        f"# Results\n\nhand-written intro\n\n{BEGIN}\nold\n{END}\n\n## Hand section\n"
    )
    args = ["report", str(bench), "--out", str(tmp_path / "docs" / "report"),
            "--results-md", str(results_md)]  # fmt: skip
    assert CliRunner().invoke(app, args).exit_code == 0
    first = results_md.read_text()
    assert first.startswith("# Results\n\nhand-written intro\n\n" + BEGIN)
    assert first.endswith(END + "\n\n## Hand section\n") and "\nold\n" not in first
    assert "](report/accuracy_vs_rollouts.png)" in first  # relative to results.md
    assert CliRunner().invoke(app, args).exit_code == 0
    assert results_md.read_text() == first  # regenerating is idempotent


def test_splice_appends_without_markers_and_rejects_a_lone_marker() -> None:
    assert splice("# R\n\nhand\n", "table") == f"# R\n\nhand\n\n{BEGIN}\n\ntable\n\n{END}\n"
    assert splice(f"a\n{BEGIN}\nx\n{END}\nb\n", "y") == f"a\n{BEGIN}\n\ny\n\n{END}\nb\n"
    with pytest.raises(ValueError, match="unmatched"):
        splice(f"a\n{END}\n", "y")


def test_report_cli_errors(tmp_path) -> None:
    missing = CliRunner().invoke(app, ["report", str(tmp_path / "nope")])
    assert missing.exit_code == 2 and "is not a directory" in missing.output
    empty = CliRunner().invoke(app, ["report", str(tmp_path), "--out", str(tmp_path / "r")])
    assert empty.exit_code == 2 and "no results under" in empty.output


def test_the_same_suite_in_two_directories_stays_two_suites(bench, tmp_path) -> None:
    import shutil

    shutil.copytree(bench / "synthetic", bench / "synthetic_long")
    results = load_results([bench])
    suites = sorted({m.suite for m in results.methods})
    assert suites == ["synthetic", "synthetic (synthetic_long)"]
    by = {(c.measure, c.method, c.baseline): c for c in CLAIMS}
    assert len(measure_claim(by[("final_gain", "dapo", "grpo")], results)) == 2


def test_the_suite_in_a_directory_of_its_name_keeps_the_name(bench) -> None:
    import shutil

    # "a_control" sorts before "synthetic": found first, it still takes the qualified name
    shutil.copytree(bench / "synthetic", bench / "a_control")
    # a summary.json of that suite without groups (baseline-mse's combined one) names nothing
    (bench / "0" / "synthetic").mkdir(parents=True)
    (bench / "0" / "synthetic" / "summary.json").write_text(json.dumps({"suite": "synthetic"}))
    suites = {m.suite for m in load_results([bench]).methods}
    assert suites == {"synthetic", "synthetic (a_control)"}


@pytest.mark.slow
def test_the_report_pairs_runs_over_held_out_prompts(tmp_path) -> None:
    from anchor_rl.bench.report import _paired_table

    root = tmp_path / "suite"
    runs = []
    # two prompts; "a" gains on both in each seed, "b" on one: per prompt by hand
    finals = {"a": [{"p0": 1, "p1": 1}, {"p0": 1, "p1": 1}], "b": [{"p0": 1, "p1": 0}] * 2}
    for label, seeds in finals.items():
        for seed, final in enumerate(seeds):
            run_dir = root / label / f"seed{seed}"
            run_dir.mkdir(parents=True)
            records = _records([0.0, 0.5, 1.0])
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (run_dir / "config.json").write_text(json.dumps({"task": "arithmetic", "seed": seed}))
            evals = [{"step": 0, "test": {"k": 1, "correct": {"p0": 0, "p1": 0}}},
                     {"step": 4, "test": {"k": 1, "correct": final}}]  # fmt: skip
            (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
            runs.append({"label": label, "seed": seed, "dir": str(run_dir),
                         "figures": run_figures(records)})  # fmt: skip
    write_summary(root, "pairs", runs, summarise(runs))
    header, rows = _paired_table(load_results([root]).methods)
    assert header[-2:] == ["vs `a` (final)", "vs baseline, prompt-only"]
    one = "+1.000 [+1.000, +1.000]"
    assert rows[0] == ["a", "2", "2", "1.000 [1.000, 1.000]", one, one, "–", "–"]
    assert rows[1][:4] == ["b", "2", "2", "0.500 [0.000, 1.000]"]
    assert rows[1][4].startswith("+0.500 [") and rows[1][5].startswith("+0.500 [")
    assert rows[1][6].startswith("-0.500 [") and rows[1][7].startswith("-0.500 [")
    # per prompt the mean over seeds is 1 and 0: the prompt-only gain's interval is [0, 1]
    assert rows[1][5] == "+0.500 [+0.000, +1.000]"


def test_a_training_run_directory_gets_its_own_report(tmp_path) -> None:
    from anchor_rl.cli import app

    run = tmp_path / "run"
    args = ["train", "model=random:tiny", "train_prompts=4", "steps=2", "rollout.prompts_per_step=2",
            "rollout.n=2", "rollout.max_new_tokens=8", "eval.every=1", "eval.prompts=4",
            "log.progress=false", "log.tensorboard=false", "--out", str(run)]  # fmt: skip
    assert CliRunner().invoke(app, args).exit_code == 0
    result = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "rep" / "report.md").read_text()
    assert "### Suite `run run` (task `arithmetic`)" in report
    assert "| run | run run | 1 |" in report  # label: the preset, or the directory's name
    results = load_results([tmp_path])
    assert [m.label for m in results.methods] == ["run"]


def test_a_summary_json_that_is_neither_a_suite_nor_a_run_is_left_out(tmp_path) -> None:
    # baseline-mse writes a combined summary.json beside its simulator and training parts
    (tmp_path / "summary.json").write_text(json.dumps({"suite": "baseline-mse", "probe": {}}))
    results = load_results([tmp_path])
    assert results.methods == [] and results.sources == []


def _write_quickstart(root) -> None:
    """A quickstart's directory (PVPO in ``root``, GRPO in ``root/grpo``) on 4 held-out
    prompts, then its raw results as the quickstart writes them. Per prompt before training
    0 1 0 1 in both runs; after, PVPO 1 1 0 1 and GRPO 1 0 0 1."""
    finals = {"pvpo": (root, 8.0, [1, 1, 0, 1]), "grpo": (root / "grpo", 0.0, [1, 0, 0, 1])}
    for preset, (run_dir, presample, final) in finals.items():
        run_dir.mkdir(parents=True)
        records = _records([0.5, 0.5, sum(final) / 4])
        for r in records:
            r["rollouts/presample"] = presample
            r["rollouts/total"] += presample
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        config = {"preset": preset, "task": "arithmetic", "model": "sft:tiny", "seed": 0,
                  "steps": 4, "train_prompts": 4, "threads": "auto", "pvpo": {"m": 2},
                  "rollout": {"prompts_per_step": 2, "n": 2}, "eval": {"prompts": 4, "every": 2},
                  "optim": {"lr": 3e-5}, "kl": {"coef": 0.001}}  # fmt: skip
        (run_dir / "config.json").write_text(json.dumps(config))
        (run_dir / "summary.json").write_text(json.dumps({"preset": preset, "steps": 4}))
        evals = [
            {"step": step, "test": {"k": 1, "correct": {f"arithmetic-test-{i}": c
                                                        for i, c in enumerate(correct)}}}
            for step, correct in ((0, [0, 1, 0, 1]), (4, final))
        ]  # fmt: skip
        (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    raw = quickstart_results.collect(root, "anchor-rl quickstart", {"sft": 0.0, "total": 9.0})
    quickstart_results.write_raw(root, raw)


def test_the_quickstart_raw_results_hold_both_runs_and_their_comparison(tmp_path) -> None:
    _write_quickstart(tmp_path / "qs")
    raw = json.loads((tmp_path / "qs" / "quickstart.json").read_text())
    pvpo, grpo = raw["runs"]["pvpo"], raw["runs"]["grpo"]
    assert (pvpo["before"], pvpo["after"], grpo["after"]) == (0.5, 0.75, 0.5)
    assert pvpo["held_out"]["after"] == {"k": 1, "ids": "arithmetic-test-{}", "counts": "1101"}
    assert pvpo["curve"][0][:2] == [0, 8.0] and grpo["curve"][0][:2] == [0, 0.0]
    assert (pvpo["rollouts_total"], grpo["rollouts_total"]) == (264.0, 256.0)
    assert pvpo["gain"]["mean"] == 0.25 and grpo["gain"]["mean"] == 0.0
    assert raw["pvpo_minus_grpo"]["mean"] == 0.25 and raw["pvpo_minus_grpo"]["prompts"] == 4
    assert raw["host"]["cpu"] and raw["settings"]["m"] == 2 and raw["sft"] is None


def test_report_shows_a_quickstart_side_by_side_without_rows_that_do_not_apply(tmp_path) -> None:
    _write_quickstart(tmp_path / "qs")
    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(tmp_path / "qs"), "--out", str(out)])
    assert result.exit_code == 0, result.output
    md = (out / "report.md").read_text()
    assert "### Quickstart `qs` (task `arithmetic`, `sft:tiny`)" in md
    assert "| held-out accuracy after training | 0.750 | 0.500 |" in md
    assert "| rollouts: presampling | 8 | 0 |" in md
    assert "PVPO minus GRPO after training: +0.250 [" in md
    assert "PVPO 0.500 → 0.750 (264 rollouts, 8 of them presampling)" in md
    assert (out / "quickstart_qs.png").stat().st_size > 0 and "](quickstart_qs.png)" in md
    # the two runs are the quickstart's, not suites of their own; no section without inputs
    assert "Suite `run" not in md and "not measured" not in md and "No `" not in md
    assert load_results([tmp_path]).methods == []


def test_a_quickstart_beside_suites_keeps_both(bench, tmp_path) -> None:
    _write_quickstart(bench / "qs")
    results = load_results([bench])
    assert [root.name for root, _ in results.quickstart] == ["qs"]
    assert sorted(m.label for m in results.methods) == ["dapo", "grpo", "grpo+n8", "pvpo+n2"]
    out = tmp_path / "report"
    assert CliRunner().invoke(app, ["report", str(bench), "--out", str(out)]).exit_code == 0
    md = (out / "report.md").read_text()
    assert "### Quickstart `qs`" in md and "| `v05+k4` vs `grpo+k16` |" in md
