"""RUN_DIR/evals.jsonl: the per-prompt results behind every evaluation (what paired
comparisons over prompts read), trimmed on resume like metrics.jsonl."""

from __future__ import annotations

import pytest

from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import read_evals, read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run


def test_every_evaluation_keeps_its_per_prompt_counts(parity, tiny, tmp_path) -> None:
    cfg = load_config("grpo", [*tiny, "steps=3", "eval.every=2", "eval.k=2",
                               "eval.temperature=1", "eval.train_prompts=4",
                               "checkpoint.every=2", "checkpoint.keep=2"])  # fmt: skip
    run = train(start_run(cfg, tmp_path / "run"))
    evals, metrics = read_evals(run.run_dir), read_metrics(run.run_dir)
    assert [e["step"] for e in evals] == [0, 2, 3]
    scored = {r["step"]: r for r in metrics if "eval/accuracy" in r}
    for e in evals:
        test, train_split = e["test"], e["train"]
        assert test["k"] == 2 and len(test["correct"]) == cfg.eval.prompts
        assert len(train_split["correct"]) == 4
        mean = sum(test["correct"].values()) / (2 * cfg.eval.prompts)
        assert scored[e["step"]]["eval/accuracy"] == pytest.approx(mean)
        assert 0 <= scored[e["step"]]["eval/maj@2"] <= 1

    with (run.run_dir / "evals.jsonl").open("a") as f:
        f.write('{"step": 3, "test"')  # torn by a kill
    with pytest.warns(UserWarning, match="torn last line"):
        resumed = train(resume_run(run.run_dir, {"steps": 4}, from_checkpoint="step_000002"))
    # the stopped run's step-3 line (after the checkpoint it resumes from) is dropped
    assert [e["step"] for e in read_evals(resumed.run_dir)] == [0, 2, 4]
