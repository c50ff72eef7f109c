"""RUN_DIR/evals.jsonl: the per-prompt results behind every evaluation (what paired
comparisons over prompts read), trimmed on resume like metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import pack_counts, read_evals, read_metrics, unpack_counts
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


def test_packed_counts_read_back_as_written(tmp_path) -> None:
    entry = {"k": 2, "correct": {f"arithmetic-test-{i}": i % 3 for i in range(12)}}
    packed = pack_counts(entry)
    assert packed == {"k": 2, "ids": "arithmetic-test-{}", "counts": "012012012012"}
    assert unpack_counts(packed) == entry
    assert pack_counts(packed) == packed  # packing twice (compacting a compact tree) is a no-op
    run = tmp_path / "run"
    run.mkdir()
    (run / "evals.jsonl").write_text(json.dumps({"step": 0, "test": packed}) + "\n")
    assert read_evals(run) == [{"step": 0, "test": entry}]
    # ids out of order or a count of two digits: left as they are
    shuffled = {"k": 1, "correct": {"q-1": 1, "q-0": 0}}
    assert pack_counts(shuffled) == shuffled
    many = {"k": 16, "correct": {"q-0": 12}}
    assert pack_counts(many) == many
