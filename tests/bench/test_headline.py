"""The equal-budget headline blocks of `anchor-rl report --readme/--results-page`: rewritten
between their markers only, idempotently, refused without markers, and their numbers the
two-level bootstrap of the fixture's per-prompt results worked out here."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from anchor_rl.bench import headline
from anchor_rl.bench.results import load_results
from anchor_rl.bench.stats import two_level_bootstrap
from anchor_rl.bench.summary import run_figures, summarise, write_summary
from anchor_rl.cli import app

BUDGET = 100
PROMPTS = ["p0", "p1", "p2", "p3"]
# label -> (group size, rollouts/total at each evaluated step, per seed: correct per evaluation)
SUITE = {
    "grpo+n2": (2, [0, 25, 50, 75, 100], [
        ["0000", "1000", "1100", "1101", "1111"],
        ["0000", "0100", "0110", "1110", "1110"],
    ]),
    # presampling spends 60 rollouts before step 0's evaluation: 25% and 50% read at step 0
    "pvpo+x": (2, [60, 80, 100], [["0000", "1000", "1011"], ["0000", "0001", "1101"]]),
    # ends at half the budget: no reading at 100%
    "short+n4": (4, [0, 25, 50], [["0000", "0010", "0011"], ["0000", "0010", "0110"]]),
}  # fmt: skip
README = "# Project\n\nintro\n\n## Results\n\n{start}\nold table\n{end}\n\nafter the block\n"


def _correct(bits: str) -> dict[str, int]:
    return {p: int(b) for p, b in zip(PROMPTS, bits, strict=True)}


def _write_suite(root, suite=SUITE) -> None:
    runs = []
    for label, (n, xs, seeds) in suite.items():
        for seed, evals in enumerate(seeds):
            run_dir = root / label / f"seed{seed}"
            run_dir.mkdir(parents=True)
            records = [
                {"step": step, "rollouts/total": float(x), "rollouts/cumulative": float(x),
                 "time/elapsed": 1.0 + step, "eval/accuracy": sum(map(int, bits)) / 4,
                 "reward/mean": 0.5, "tokens/cumulative": 10.0 * x, "time/generate": 1.0,
                 "time/score": 0.1, "time/update": 0.5}
                for step, (x, bits) in enumerate(zip(xs, evals, strict=True))
            ]  # fmt: skip
            lines = [{"step": s, "test": {"k": 1, "correct": _correct(b)}} for s, b in
                     enumerate(evals)]  # fmt: skip
            (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
            (run_dir / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
            config = {"task": "arithmetic", "seed": seed, "rollout": {"n": n}}
            (run_dir / "config.json").write_text(json.dumps(config))
            runs.append({"label": label, "seed": seed, "dir": str(run_dir),
                         "figures": run_figures(records)})  # fmt: skip
    budget = {"rollouts": BUDGET, "mode": BUDGET, "to_budget": ["pvpo+x"]}
    write_summary(root, "pvpo_budget", runs, summarise(runs), extra={"budget": budget})


def _cell(rows, minus=None) -> str:
    """The two-level bootstrap of per-prompt rows, formatted as the tables write it."""
    b = two_level_bootstrap(rows, minus, paired_runs=minus is not None)
    f = "+.3f" if minus is not None else ".3f"
    return f"{b.mean:{f}} [{b.low:{f}}, {b.high:{f}}]"


def _rows(label: str, index: int) -> list[list[float]]:
    return [[float(b) for b in seeds[index]] for seeds in SUITE[label][2]]


@pytest.fixture
def suite(tmp_path):
    root = tmp_path / "results" / "pvpo_budget"
    _write_suite(root)
    return root


def _readme(tmp_path, markers=headline.README_MARKERS, name="README.md"):
    path = tmp_path / name
    path.write_text(README.format(start=markers[0], end=markers[1]))
    return path


def test_the_numbers_are_the_two_level_bootstrap_of_the_readings(suite) -> None:
    text = headline.readme_block(headline.headline(load_results([suite])))
    lines = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| `")}
    # grpo+n2 reads at 25 / 50 / 100 its evaluations 1, 2, 4
    grpo = lines["| `grpo+n2`"]
    assert (
        grpo
        == "| `grpo+n2` | 2 | 4 | 100 | "
        + " | ".join(_cell(_rows("grpo+n2", i)) for i in (1, 2, 4))
        + " |"
    )
    # pvpo+x's presampling spent 25% and 50% of the budget before step 0
    pvpo = lines["| `pvpo+x`"]
    step0 = _cell(_rows("pvpo+x", 0)) + " *step 0*"
    assert pvpo == f"| `pvpo+x` | 2 | 2 | 100 | {step0} | {step0} | {_cell(_rows('pvpo+x', 2))} |"
    assert lines["| `short+n4`"].endswith(f" | {_cell(_rows('short+n4', 2))} | – |")
    assert "two-level bootstrap" in text and "then the held-out prompts" in text


def test_the_page_block_subtracts_the_baseline_and_gives_the_prompt_only_interval(suite) -> None:
    data = headline.headline(load_results([suite]), baseline="grpo+n2")
    text = headline.page_block(data)
    diff = next(line for line in text.splitlines() if line.startswith("| `pvpo+x` | -"))
    full = _cell(_rows("pvpo+x", 2), _rows("grpo+n2", 4))
    assert f" | {full} | " in diff  # at 100%: evaluation 2 minus grpo's evaluation 4
    row = next(line for line in text.splitlines() if line.startswith("| `grpo+n2` | 2"))
    prompt_only = data["comparison"]["labels"]["grpo+n2"]["at"][1.0]["prompt_only"]
    assert row.endswith(f" | {prompt_only['mean']:.3f} [{prompt_only['low']:.3f}, "
                        f"{prompt_only['high']:.3f}] |")  # fmt: skip
    assert "minus `grpo+n2`" in text and "| `grpo+n2` | -" not in text
    # an absent baseline falls back to the suite's first label
    assert headline.headline(load_results([suite]), baseline="nope")["baseline"] == "grpo+n2"


def test_every_label_of_the_raw_results_gets_a_row(tmp_path) -> None:
    root = tmp_path / "pvpo_budget"
    _write_suite(root, {**SUITE, "perfect+n2_100": (2, [0, 25], [["0000", "1111"]] * 2)})
    text = headline.readme_block(headline.headline(load_results([root])))
    assert "| `perfect+n2_100` | 2 | 1 | 25 | 1.000 [1.000, 1.000] | – | – |" in text


def test_replace_block_keeps_the_outside_and_refuses_missing_markers(tmp_path) -> None:
    start, end = headline.README_MARKERS
    text = f"a\n{start}\nold\n{end}\nb\n"
    once = headline.replace_block(text, headline.README_MARKERS, "new\n")
    assert once == f"a\n{start}\n\nnew\n\n{end}\nb\n"
    assert headline.replace_block(once, headline.README_MARKERS, "new") == once
    for broken in (f"a\n{start}\nx\n", f"a\n{end}\n{start}\n", f"{start}{end}{start}{end}"):
        with pytest.raises(ValueError, match="needs exactly one"):
            headline.replace_block(broken, headline.README_MARKERS, "new", "README.md")
    with pytest.raises(FileNotFoundError):
        headline.check_blocks(tmp_path / "absent.md")


def test_report_rewrites_both_blocks_idempotently(suite, tmp_path) -> None:
    readme = _readme(tmp_path)
    page = _readme(tmp_path, headline.PAGE_MARKERS, "results.md")
    args = ["report", str(suite.parent), "--out", str(tmp_path / "report"),
            "--readme", str(readme), "--results-page", str(page)]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    first, first_page = readme.read_text(), page.read_text()
    head, tail = README.split("{start}")[0], README.split("{end}")[1]
    assert first.startswith(head + headline.README_MARKERS[0] + "\n\nSuite `pvpo_budget`")
    assert first.endswith(headline.README_MARKERS[1] + tail) and "old table" not in first
    assert "| `pvpo+x` |" in first and "area under the curve" in first_page
    assert CliRunner().invoke(app, args).exit_code == 0
    assert readme.read_text() == first and page.read_text() == first_page


def test_report_refuses_a_readme_without_markers_before_writing_anything(suite, tmp_path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("# Project\n\nno markers\n")
    out = tmp_path / "report"
    args = ["report", str(suite.parent), "--out", str(out), "--readme", str(readme)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "<!-- results:start -->" in result.output
    assert readme.read_text() == "# Project\n\nno markers\n" and not out.exists()
    other = _readme(tmp_path)
    wrong = ["report", str(suite.parent), "--out", str(out), "--readme", str(other),
             "--budget-suite", "nope"]  # fmt: skip
    result = CliRunner().invoke(app, wrong)
    assert result.exit_code == 2 and "no results of suite 'nope'" in result.output
