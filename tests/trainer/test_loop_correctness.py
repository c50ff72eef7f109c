"""Defects a review found in the loop, each pinned by a test that failed before its fix:
dropout in the old log-probs, the KL of teacher rows, V0.5's order against PVPO's teacher
rows; and the single-pass update (optim.rescore) changing no metric. (Teacher log-probs at
T != 1: tests/anchors/test_anchors_teachers.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import metrics_but_timings

from anchor_rl.algos.losses import kl
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import disable_dropout, save_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer import loop
from anchor_rl.trainer import update as update_mod
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train, train_step
from anchor_rl.trainer.run import start_run
from anchor_rl.trainer.update import token_mean


@pytest.fixture
def dropout_model(tmp_path):
    """A tiny Llama directory whose attention has dropout 0.2 (as many HF checkpoints do)."""
    tokenizer = build_tokenizer()
    model = build_model("tiny", tokenizer, seed=0)
    model.config.attention_dropout = 0.2
    return save_policy(model, tokenizer, tmp_path / "dropout-model")


def _first_step(tiny, tmp_path, model_dir, *extra):
    cfg = load_config(
        "grpo",
        [*tiny, f"model={model_dir}", "optim.lr=0", "optim.epochs=1", "optim.mini_batches=1",
         "steps=1", "eval.every=0", *extra],
    )  # fmt: skip
    run = train(start_run(cfg, tmp_path / "run"))
    return read_metrics(run.run_dir)[-1]


def test_dropout_is_off_by_default_so_the_first_ratio_is_exactly_one(
    parity, tiny, tmp_path, dropout_model
) -> None:
    step = _first_step(tiny, tmp_path, dropout_model, "optim.rescore=always")
    # lr 0, one epoch, one mini-batch: the update's log-probs are the old ones on every token
    assert step["policy/ratio_mean"] == 1.0 and step["policy/approx_kl"] == 0.0
    assert step["policy/clipfrac_low"] == step["policy/clipfrac_high"] == 0.0


def test_keeping_dropout_keeps_it_in_the_update_only(parity, tiny, tmp_path, dropout_model) -> None:
    step = _first_step(tiny, tmp_path, dropout_model, "disable_dropout=false")
    assert step["policy/approx_kl"] > 0  # the update's dropout masks move the ratio off 1


def test_disable_dropout_zeroes_modules_and_attention_rates() -> None:
    model = build_model("tiny", build_tokenizer(), seed=0)
    model.config.attention_dropout = 0.3
    model.model.layers[0].self_attn.attention_dropout = 0.3
    model.model.layers[0].extra = torch.nn.Dropout(0.1)
    assert disable_dropout(model) == 2
    assert model.model.layers[0].self_attn.attention_dropout == 0.0
    assert model.model.layers[0].extra.p == 0.0
    assert disable_dropout(model) == 0


def test_kl_to_the_reference_is_the_policys_own_on_teacher_rows(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    """A teacher row's behaviour log-probs (the ratio's denominator) are the teacher's; its
    KL to the reference, in the metric and in the reward, is the policy's own."""
    from test_pvpo import _trajectory

    cfg = load_config(
        "pvpo_paper",  # the paper's presampling: the walk is sampled by start_run
        [*tiny, "pvpo.m=2", f"pvpo.store={tmp_path / 'a.db'}", "pvpo.teacher=none",
         "pvpo.keep_unsolved=true", "kl.track=true"],
    )  # fmt: skip
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    pvpo.trajectories = {r.id: _trajectory(r.id, -0.25) for r in pvpo.records}
    scored_logp = []
    real_score = update_mod.score_logprobs

    def spy(model, batch, cfg, with_entropy=False):
        out = real_score(model, batch, cfg, with_entropy)
        scored_logp.append((batch, out[0]))
        return out

    monkeypatch.setattr(loop, "score_logprobs", spy)
    metrics = train_step(run)
    (batch, policy_logp), (_, ref_logp) = scored_logp
    assert metrics["pvpo/teacher_rows"] == cfg.rollout.prompts_per_step
    by_hand = token_mean(kl(policy_logp, ref_logp, cfg.kl.kind), batch.loss_mask)
    assert metrics["kl/ref"] == pytest.approx(by_hand, rel=1e-6)


def test_v05_fuses_and_learns_before_pvpo_injects_teacher_rows(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    """V0.5 with group sampling: the fused baseline and the prior's update see the policy's own
    rollouts only; a teacher row then replaces one of them, and its prompt keeps the baseline
    fused without it."""
    from test_pvpo import CORRECT, IDS, _seed_store

    store = tmp_path / "a.db"
    cfg = load_config(
        "v05",
        [*tiny, "filter.kind=group", "pvpo.teacher=oracle", "pvpo.m=2", f"pvpo.store={store}",
         "rollout.budget=fixed", "rollout.prompts_per_step=4", "v05.prior=anchor"],
    )  # fmt: skip
    _seed_store(cfg, parity, store, CORRECT)  # train-4..7 never solved: teacher rows
    run = start_run(cfg, tmp_path / "run")
    assert list(run.components) == ["v05", "pvpo"]
    v05, pvpo = run.components["v05"], run.components["pvpo"]
    assert sorted(pvpo.trajectories) == IDS[4:]
    events = []
    real_update, real_inject = v05.prior.update, pvpo.on_rollouts

    def prior_update(ids, rewards, embeddings=None):
        events.append(("prior", list(ids), [r.tolist() for r in rewards]))
        real_update(ids, rewards, embeddings)

    def inject(step):
        before = step.scored
        real_inject(step)
        events.append(("teacher", before, step.scored))

    monkeypatch.setattr(v05.prior, "update", prior_update)
    monkeypatch.setattr(pvpo, "on_rollouts", inject)
    seen = {}
    real_compute = loop.compute_advantages

    def compute(cfg, inputs):
        seen["inputs"] = inputs
        return real_compute(cfg, inputs)

    monkeypatch.setattr(loop, "compute_advantages", compute)
    train_step(run)
    assert [e[0] for e in events] == ["prior", "teacher"]  # V0.5 first
    _, ids, learned = events[0]
    _, before, after = events[1]
    group = before.batch.group
    assert learned == [before.rewards[group == g].tolist() for g in range(len(ids))]
    assert after.off_policy.sum() == sum(i in pvpo.trajectories for i in ids) > 0
    assert not before.off_policy.any()  # what V0.5 fused had no teacher row in it
    # every response of a prompt, the teacher's included, gets the baseline fused before it
    baseline = seen["inputs"]["baseline"]
    assert torch.equal(baseline, v05.fused[after.batch.group])


@pytest.mark.parametrize("preset", ["grpo", "rloo"])
def test_the_single_pass_changes_no_metric(preset, parity, tiny, tmp_path) -> None:
    """grpo (KL in the loss) takes the single pass; rloo (KL in the reward) cannot."""

    def run(rescore: str) -> list[dict]:
        cfg = load_config(preset, [*tiny, "steps=2", "eval.every=0", f"optim.rescore={rescore}"])
        return metrics_but_timings(train(start_run(cfg, tmp_path / rescore)).run_dir)

    fast, plain = run("auto"), run("always")
    assert [r["update/single_pass"] for r in fast] == [float(preset == "grpo")] * 2
    assert [r.pop("update/single_pass") for r in plain] == [0.0, 0.0]
    for r in fast:
        r.pop("update/single_pass")
    # the work differs, not the numbers: the single pass scores each token once
    pairs = zip(fast, plain, strict=True)
    scored = [(a.pop("tokens/scored"), b.pop("tokens/scored")) for a, b in pairs]
    assert all(f < p if preset == "grpo" else f == p for f, p in scored)
    assert len(fast) == len(plain) == 2
    for a, b in zip(fast, plain, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], abs=1e-6), key
