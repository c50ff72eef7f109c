"""End to end on a random-init tiny model: every preset, metrics sinks, dynamic sampling, resume."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
import torch
from helpers import requests
from safetensors.torch import load_file
from typer.testing import CliRunner

from anchor_rl.batch import RolloutBatch
from anchor_rl.cli import app
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.collect import Scored, collect, informative_groups, score
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.logging import open_sinks, read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run
from anchor_rl.trainer.timing import Timer

STEP_KEYS = {
    "reward/mean", "accuracy", "response/length", "policy/entropy", "kl/ref",
    "policy/clipfrac_low", "policy/clipfrac_high", "advantage/mean", "advantage/std",
    "advantage/zero_frac", "rollouts/cumulative", "tokens/cumulative",
    "time/generate", "time/score", "time/update", "time/sync", "loss/policy", "grad_norm", "lr",
}  # fmt: skip
EVAL_KEYS = {"eval/accuracy", "eval/reward", "eval/length"}


def _tb_scalar_tags(run_dir) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.slow
@pytest.mark.parametrize(
    "preset", ["dapo", "drgrpo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
)
def test_one_step_of_every_preset_writes_all_metrics(preset, parity, tiny, tmp_path) -> None:
    cfg = load_config(preset, [*tiny, "steps=1", "eval.every=1"])
    run = train(start_run(cfg, tmp_path / preset))
    records = read_metrics(run.run_dir)
    assert [r["step"] for r in records] == [0, 1]
    assert set(records[0]) >= EVAL_KEYS
    assert set(records[1]) >= STEP_KEYS | EVAL_KEYS
    assert records[1]["rollouts/cumulative"] == 8 * records[1]["filter/rounds"]
    assert _tb_scalar_tags(run.run_dir) >= STEP_KEYS | EVAL_KEYS
    assert (run.run_dir / "summary.json").is_file()
    assert len(list_checkpoints(run.run_dir)) == 1  # the final step is always saved
    # the KL term is where the preset puts it: a loss term (grpo), in the reward (rloo,
    # reinforce_pp*: no loss term), or nowhere (dapo, drgrpo); kl.track logs it in every case
    in_loss = preset == "grpo"
    assert ("loss/kl" in records[1]) == in_loss
    assert (cfg.kl.coef > 0) == (
        preset in {"grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"}
    )
    assert "kl/ref" in records[1] and records[1]["kl/ref"] >= 0


@pytest.mark.slow
def test_grpo_learns_the_parity_task(parity, tiny, tmp_path) -> None:
    """Reward about 1/2 at random init; 20 GRPO steps push it well above (seeded, not timed)."""
    batch = ["rollout.prompts_per_step=8", "rollout.n=8", "rollout.max_new_tokens=4"]
    cfg = load_config("grpo", [*tiny, *batch, "steps=20", "eval.every=0", "optim.lr=1e-3"])
    rewards = [
        r["reward/mean"] for r in read_metrics(train(start_run(cfg, tmp_path / "p")).run_dir)
    ]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.7 and last > first + 0.15


class _ScriptedEngine:
    """Returns scripted completions, one list of texts per group per call."""

    def __init__(self, rounds: list[list[list[str]]]) -> None:
        self.rounds = iter(rounds)

    def rollout(self, requests, params, tools=None, instruction=None):
        texts = [t for group in next(self.rounds) for t in group]
        assert len(texts) == len(requests)
        b = len(texts)
        ones = torch.ones(b, 1)
        return RolloutBatch(
            group=torch.tensor([r.group for r in requests]),
            prompt_ids=[[1]] * b, response_ids=torch.full((b, 1), 7), attention_mask=ones,
            loss_mask=ones, logprobs=torch.zeros(b, 1), texts=texts,
            tool_calls=torch.zeros(b, dtype=torch.long), truncated=torch.zeros(b, dtype=torch.bool),
        )  # fmt: skip


# "0" is even (reward 1), "1" is odd (reward 0)
SCRIPT = [
    [["0", "0"], ["0", "1"]],  # round 1: group 0 all equal, group 1 mixed
    [["1", "1"], ["1", "1"]],  # round 2: nothing informative
    [["1", "0"], ["0", "1"]],  # round 3: both mixed
]


@pytest.mark.parametrize(("max_rounds", "kept", "rounds"), [(3, 2, 3), (2, 1, 2), (1, 1, 1)])
def test_dynamic_sampling_drops_equal_groups_and_is_bounded(
    max_rounds, kept, rounds, parity
) -> None:
    cfg = load_config(
        "dapo", ["rollout.prompts_per_step=2", "rollout.n=2", f"filter.max_rounds={max_rounds}"]
    )
    task = parity
    sampler = PromptSampler(task.records("train"), seed=0)
    scored, metrics = collect(_ScriptedEngine(SCRIPT), sampler, task, cfg, Timer())
    assert metrics["filter/rounds"] == rounds and metrics["filter/kept_groups"] == kept
    assert metrics["rollouts/step"] == 4 * rounds  # filtered responses still count
    assert sampler.consumed == 2 * rounds
    assert len(scored.records) == kept and len(scored) == 2 * kept
    assert informative_groups(scored).all()
    assert scored.batch.group.tolist() == [g for g in range(kept) for _ in range(2)]
    # round 1's mixed group first, then round 3's first mixed group
    expected_texts = ["0", "1", "1", "0"][: 2 * kept]
    assert scored.batch.texts == expected_texts
    assert scored.rewards.tolist() == [1.0 if t == "0" else 0.0 for t in expected_texts]


def test_score_adds_the_soft_overlong_punishment(parity) -> None:
    # max_new_tokens 10, window 0.2 -> L_cache 2: free up to 8 tokens, -0.5 at 9, -1 at 10
    cfg = load_config("dapo", ["rollout.max_new_tokens=10"])
    batch = _ScriptedEngine([[["0", "0", "1"]]]).rollout(requests(["q"], 3), None)
    lengths = torch.tensor([8, 9, 10])
    batch.attention_mask = (torch.arange(10) < lengths[:, None]).float()
    batch.response_ids = torch.full((3, 10), 7)
    batch.loss_mask, batch.logprobs = batch.attention_mask, torch.zeros(3, 10)
    scored = score(parity, batch, [Record("0", "q", "even")], cfg)
    assert scored.task_rewards.tolist() == [1.0, 1.0, 0.0]
    assert scored.rewards.tolist() == [1.0, 0.5, -1.0]
    assert scored.correct.tolist() == [True, True, False]


def test_informative_groups_by_hand() -> None:
    rows = 6
    batch = _ScriptedEngine([[["0", "0"], ["0", "1"], ["1", "1"]]]).rollout(
        requests(["a", "b", "c"], 2), None
    )
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    records = [Record(str(i), "q", "a") for i in range(3)]
    scored = Scored(batch, records, rewards, rewards, rewards > 0)
    for metric in ("correct", "reward"):
        assert informative_groups(scored, metric).tolist() == [False, True, False]
    assert len(scored) == rows
    with pytest.raises(ValueError, match="use correct or reward"):
        informative_groups(scored, "accuracy")


def test_dynamic_sampling_drops_shaped_groups_all_right_or_all_wrong() -> None:
    """The overlong punishment docks one response of an all-correct group and one of an
    all-wrong group: DAPO's filter (metric=correct) drops both, the shaped rewards differ."""
    batch = _ScriptedEngine([[["0", "0"], ["0", "1"], ["1", "1"]]]).rollout(
        requests(["a", "b", "c"], 2), None
    )
    correct = torch.tensor([True, True, True, False, False, False])
    shaped = correct.float() + torch.tensor([0.0, -0.25, 0.0, 0.0, 0.0, -0.5])
    records = [Record(str(i), "q", "a") for i in range(3)]
    scored = Scored(batch, records, shaped, correct.float(), correct)
    assert informative_groups(scored).tolist() == [False, True, False]
    assert informative_groups(scored, "reward").tolist() == [True, True, True]


@pytest.mark.slow
def test_resume_reproduces_the_metrics_exactly(parity, tiny, tmp_path) -> None:
    overrides = [*tiny, "optim.lr=1e-2", "checkpoint.every=2"]
    straight = train(start_run(load_config("grpo", [*overrides, "steps=4"]), tmp_path / "straight"))
    half = train(start_run(load_config("grpo", [*overrides, "steps=2"]), tmp_path / "resumed"))
    resumed = train(resume_run(half.run_dir, {"steps": 4}))

    def values(run):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/")}
            for r in read_metrics(run.run_dir)
        ]

    a, b = values(straight), values(resumed)
    assert [r["step"] for r in a] == [0, 1, 2, 3, 4]
    assert any(r.get("grad_norm", 0) > 0 for r in a)  # the updates were real
    assert a == b
    weights = [
        load_file(list_checkpoints(r.run_dir)[-1] / "policy" / "model.safetensors")
        for r in (straight, resumed)
    ]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


@pytest.mark.slow
def test_time_limit_ends_the_run_after_the_step_that_reaches_it(parity, tiny, tmp_path) -> None:
    cfg = load_config("grpo", [*tiny, "steps=5", "eval.every=0", "time_limit=1e-9"])
    run = train(start_run(cfg, tmp_path / "t"))
    assert [r["step"] for r in read_metrics(run.run_dir)] == [1]
    assert [p.name for p in list_checkpoints(run.run_dir)] == ["step_000001"]


@pytest.mark.slow
def test_resume_drops_metrics_written_after_the_checkpoint(parity, tiny, tmp_path) -> None:
    run = train(
        start_run(
            load_config("grpo", [*tiny, "steps=3", "checkpoint.every=2", "checkpoint.keep=2"]),
            tmp_path / "r",
        )
    )
    # pretend the run died after logging step 3 but before its checkpoint
    for path in list_checkpoints(run.run_dir):
        if path.name == "step_000003":
            shutil.rmtree(path)
    resumed = resume_run(run.run_dir)
    assert resumed.state.step == 2
    train(resumed)
    assert [r["step"] for r in read_metrics(run.run_dir)] == [0, 1, 2, 3]


def test_resume_refuses_to_change_what_the_run_learns(parity, tiny, tmp_path) -> None:
    from anchor_rl.trainer.config import ConfigError

    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(load_config("grpo", tiny).model_dump_json())
    with pytest.raises(ConfigError, match="kl.coef"):
        resume_run(run_dir, {"kl.coef": 0.5})
    # no checkpoint yet (it stopped during set-up): --resume starts it from step 0
    assert resume_run(run_dir, {"steps": 9}).state.step == 0


@pytest.mark.parametrize("sink", ["wandb", "mlflow"])
def test_optional_sink_asked_for_but_missing_fails_clearly(sink, tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, sink, None)  # makes `import wandb` / `import mlflow` fail
    cfg = load_config("grpo", [f"log.{sink}=true", "log.tensorboard=false"])
    with pytest.raises(ImportError, match=rf"log\.{sink}=true needs the '{sink}' package"):
        open_sinks(cfg.log, tmp_path, {})


@pytest.mark.slow
def test_cli_trains_and_rejects_bad_input(parity, tiny, tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli"
    result = runner.invoke(
        app, ["train", "--preset", "drgrpo", *tiny, "steps=1", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["preset"] == "drgrpo"
    bad = runner.invoke(
        app, ["train", "--preset", "grpo", "rollout.n=0", "--out", str(tmp_path / "bad")]
    )
    assert bad.exit_code == 2 and "rollout.n" in bad.output
    assert not (tmp_path / "bad").exists()  # failed before any work
    same = runner.invoke(app, ["train", "--preset", "drgrpo", *tiny, "steps=1", "--out", str(out)])
    assert same.exit_code == 2 and f"continue it with anchor-rl train --resume {out}" in same.output
    other = runner.invoke(app, ["train", "--preset", "grpo", *tiny, "--out", str(out)])
    assert other.exit_code == 2 and "holds another run" in other.output


def test_show_config_checks_the_task_and_shows_a_resumed_runs_overrides(
    parity, tiny, tmp_path
) -> None:
    runner = CliRunner()
    shown = runner.invoke(app, ["train", "--preset", "grpo", *tiny, "steps=3", "--show-config"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["steps"] == 3
    bad_task = ["train", "--preset", "grpo", "task=arithmetic", "task_args.levels=3"]
    refused = runner.invoke(app, [*bad_task, "--show-config"])
    assert refused.exit_code == 2 and "task_args.levels" in refused.output
    out = tmp_path / "run"
    trained = runner.invoke(app, ["train", "--preset", "grpo", *tiny, "steps=1", "--out", str(out)])
    assert trained.exit_code == 0, trained.output
    resumed = runner.invoke(app, ["train", "--resume", str(out), "steps=4", "--show-config"])
    assert resumed.exit_code == 0, resumed.output
    assert json.loads(resumed.output)["steps"] == 4  # the override, not the stored 1
    assert json.loads((out / "config.json").read_text())["steps"] == 1  # nothing written
    changed = runner.invoke(app, ["train", "--resume", str(out), "kl.coef=0", "--show-config"])
    assert changed.exit_code == 2 and "cannot change on resume" in changed.output


def test_show_config_of_a_resume_refuses_what_the_resume_refuses(parity, tiny, tmp_path) -> None:
    runner = CliRunner()
    out = tmp_path / "run"
    trained = runner.invoke(app, ["train", "--preset", "grpo", *tiny, "steps=2", "--out", str(out)])
    assert trained.exit_code == 0, trained.output
    stored = (out / "config.json").read_text()
    refusals = {  # the command line after `train --resume RUN_DIR` -> what the error names
        ("steps=1",): "steps=1 is below the checkpoint's step 2",
        ("steps=3", "--from", "step_000099"): "no checkpoint 'step_000099'; it has step_000002",
    }
    for args, message in refusals.items():
        shown = runner.invoke(app, ["train", "--resume", str(out), *args, "--show-config"])
        assert shown.exit_code == 2 and message in shown.output, shown.output
        resumed = runner.invoke(app, ["train", "--resume", str(out), *args])
        assert resumed.exit_code == 2 and message in resumed.output, resumed.output
    assert (out / "config.json").read_text() == stored  # nothing resumed, nothing written
    chosen = ["--from", "step_000002", "steps=3", "log.tensorboard=false", "--show-config"]
    shown = runner.invoke(app, ["train", "--resume", str(out), *chosen])
    assert shown.exit_code == 0, shown.output
    config = json.loads(shown.output)
    assert config["steps"] == 3 and config["log"]["tensorboard"] is False  # the overrides


def test_eval_on_training_prompts_is_the_train_split_capped_at_train_prompts(
    parity, tiny, monkeypatch
) -> None:
    from anchor_rl.rollout import evaluate as evaluate_module
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.spec import load_spec
    from anchor_rl.trainer import run as run_module

    calls = []

    def spy(engine, task, split, **kwargs):
        result = evaluate_module.evaluate(engine, task, split, **kwargs)
        calls.append((split, kwargs["limit"], result))
        return result

    monkeypatch.setattr(run_module, "evaluate", spy)
    cfg = load_config("grpo", [*tiny, "train_prompts=5", "eval.train_prompts=50"])
    model, tokenizer = load_spec(cfg.model, cfg.task, cfg.task_args, cfg.seed, "cpu", False)
    engine = make_engine("hf", model, tokenizer)
    metrics = run_module.evaluate_model(engine, parity, cfg, step=0)
    assert [(split, limit) for split, limit, _ in calls] == [("test", 3), ("train", 5)]
    assert calls[1][2]["prompts"] == 5
    assert metrics["eval/train_accuracy"] == calls[1][2]["avg@1"]
    calls.clear()
    off = run_module.evaluate_model(engine, parity, load_config("grpo", tiny), step=0)
    assert "eval/train_accuracy" not in off and [c[0] for c in calls] == ["test"]
