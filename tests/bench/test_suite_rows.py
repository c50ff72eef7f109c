"""scripts/suite_rows.py: the figures docs/results.md's hand tables quote, from summary.json."""

from __future__ import annotations

import json

import pytest
from helpers import load_script


def _figure(values, half_width):
    mean = sum(values) / len(values)
    return {"mean": mean, "half_width": half_width, "low": mean - half_width,
            "high": mean + half_width, "n": len(values), "values": values}  # fmt: skip


def test_rows_quote_per_seed_values_both_intervals_and_the_baseline_difference(tmp_path):
    boot = {"mean": 0.01, "low": -0.002, "high": 0.022, "prompts": 1000, "resamples": 10000}
    summary = {
        "groups": [
            {"label": "grpo", "figures": {"eval_final": _figure([0.5, 0.6, 0.7], 0.25),
                                          "eval_gain": _figure([0.0, 0.1, 0.2], 0.25),
                                          "rollouts": _figure([6400.0] * 3, 0.0)}},
            {"label": "pvpo", "figures": {  # one seed: no t interval (low/high None)
                "eval_final": _figure([0.61], 0.0),
                "eval_gain": {"mean": 0.05, "half_width": None, "low": None, "high": None,
                              "n": 1, "values": [0.05]}}},
        ],
        "paired": {"baseline": "grpo", "gain": {"grpo": boot}, "vs_baseline": {"pvpo": boot}},
    }  # fmt: skip
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    header, grpo, pvpo = load_script("suite_rows").rows(tmp_path, ("rollouts", "wall_s"))
    assert "vs `grpo`" in header and header.endswith("rollouts | wall_s |")
    assert grpo.startswith(
        "| grpo | 0.600 ± 0.250 (0.500 / 0.600 / 0.700) | +0.010 [-0.002, +0.022] / "
        "[-0.150, +0.350] | – | 6400 ± 0 | – |"
    )
    assert pvpo.startswith("| pvpo | 0.610 (0.610) | – / – | +0.010 [-0.002, +0.022] |")


def test_against_pairs_every_run_with_another_baseline_over_held_out_prompts(tmp_path):
    # three prompts; "a" ends one prompt ahead of "b": per prompt +1, 0, 0 (mean +1/3)
    finals = {"a": {"p0": 1, "p1": 1, "p2": 0}, "b": {"p0": 0, "p1": 1, "p2": 0}}
    for label, final in finals.items():
        run = tmp_path / label / "seed0"
        run.mkdir(parents=True)
        evals = [{"step": 0, "test": {"k": 1, "correct": {"p0": 0, "p1": 0, "p2": 0}}},
                 {"step": 5, "test": {"k": 1, "correct": final}}]  # fmt: skip
        (run / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    runs = [{"label": label, "seed": 0} for label in finals]
    (tmp_path / "summary.json").write_text(json.dumps({"runs": runs, "groups": []}))
    script = load_script("suite_rows")
    assert script.against(tmp_path, "b") == ["a vs b: +0.333 [+0.000, +1.000]"]
    with pytest.raises(SystemExit, match="no run 'c'"):
        script.against(tmp_path, "c")
