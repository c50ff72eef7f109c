"""The critic in the trainer: GAE targets by hand, the VAPO knobs one by one, the critic's
update, checkpoint/resume, and the ppo and vapo presets end to end on a random-init model."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from anchor_rl.batch import RolloutBatch
from anchor_rl.methods.vapo import critic_metrics, critic_targets, policy_lambda
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.models.value_pretrain import mc_returns
from anchor_rl.tasks import get_task
from anchor_rl.tasks.base import Record
from anchor_rl.trainer import critic as critic_mod
from anchor_rl.trainer import loop as loop_mod
from anchor_rl.trainer.advantage import base_inputs, compute_advantages
from anchor_rl.trainer.checkpoint import latest_checkpoint, load_components
from anchor_rl.trainer.collect import Scored
from anchor_rl.trainer.component import Setup, Step
from anchor_rl.trainer.config import ConfigError, TrainConfig, load_config
from anchor_rl.trainer.critic import (
    PRETRAIN_FILE,
    PPOCritic,
    critic_optimizer,
    critic_update,
    critic_values,
    new_critic,
)
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run
from anchor_rl.trainer.timing import Timer
from anchor_rl.trainer.update import loss_terms, loss_weights


def _cfg(*overrides: str, preset: str = "ppo") -> TrainConfig:
    return load_config(preset, list(overrides))


def _toy_batch(prompts: list[list[int]], responses: list[list[int]], policy: list[list[int]]):
    """A RolloutBatch; ``policy`` marks the policy's tokens (0: tool output)."""
    b, t = len(responses), max(map(len, responses))
    ids = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t)
    loss = torch.zeros(b, t)
    for i, (row, pol) in enumerate(zip(responses, policy, strict=True)):
        ids[i, : len(row)] = torch.tensor(row)
        attention[i, : len(row)] = 1
        loss[i, : len(row)] = torch.tensor(pol, dtype=torch.float32)
    return RolloutBatch(
        group=torch.arange(b), prompt_ids=prompts, response_ids=ids, attention_mask=attention,
        loss_mask=loss, logprobs=torch.zeros(b, t), texts=[""] * b,
        tool_calls=torch.zeros(b, dtype=torch.long), truncated=torch.zeros(b, dtype=torch.bool),
    )  # fmt: skip


@pytest.fixture(scope="module")
def policy():
    return build_model("tiny", build_tokenizer(), seed=0)


@dataclass
class Targets:
    values: Tensor
    advantages: Tensor
    returns: Tensor
    policy_lam: Tensor


def gae_targets(cfg, rewards, mask, values, logp, ref_logp) -> Targets:
    """Stage 5 of a critic run on one batch, through the trainer's own functions: the loop's
    inputs, the critic's values and lambda, the registered ``gae`` estimator, the critic's
    returns and whitening."""
    inputs = base_inputs(cfg, rewards, torch.arange(len(rewards)), mask, logp, ref_logp)
    inputs |= {"values": values, "lam": policy_lambda(cfg.critic, mask)}
    advantages = compute_advantages(cfg, inputs)
    advantages, returns = critic_targets(cfg.critic, cfg.advantage.gamma, inputs, advantages)
    return Targets(values, advantages, returns, inputs["lam"])


def _component(cfg, policy) -> PPOCritic:
    """A fresh critic component for ``policy``, as a resumed run builds it (no value
    pretraining; its state comes from a checkpoint or stays fresh)."""
    setup = Setup(cfg=cfg, run_dir=None, task=None, records=[], policy=policy, tokenizer=None,
                  engine=None, generator=torch.Generator().manual_seed(0), resuming=True)  # fmt: skip
    return PPOCritic(setup)


# --- presets --------------------------------------------------------------------------


def test_ppo_and_vapo_presets_set_what_the_paper_sets() -> None:
    ppo, vapo, default = _cfg(preset="ppo"), _cfg(preset="vapo"), TrainConfig()
    for cfg in (ppo, vapo):
        assert cfg.advantage.estimator == "gae" and cfg.advantage.gamma == 1.0
        assert cfg.critic.mode == "separate" and cfg.kl.coef == 0.0
        # run scale stays at the defaults; group sampling only re-splits the rollouts
        assert cfg.optim == default.optim
        per_step = cfg.rollout.prompts_per_step * cfg.rollout.n
        assert per_step == default.rollout.prompts_per_step * default.rollout.n
    assert (ppo.critic.policy_lam, ppo.critic.lam, ppo.critic.pretrain_steps) == (0.95, "policy", 0)
    assert (ppo.loss.agg, ppo.loss.clip_low, ppo.loss.clip_high, ppo.loss.nll_coef) == (
        "seq-mean-token-mean", 0.2, 0.2, 0.0)  # fmt: skip
    c = vapo.critic
    assert (c.pretrain_steps, c.lam, c.policy_lam, c.lam_alpha) == (50, 1.0, "adaptive", 0.05)
    assert (vapo.loss.agg, vapo.loss.clip_low, vapo.loss.clip_high, vapo.loss.nll_coef) == (
        "token-mean", 0.2, 0.28, 0.1)  # fmt: skip
    assert vapo.rollout.n == 16 > ppo.rollout.n


def test_bad_critic_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="critic.lam"):
        _cfg("critic.lam=1.5")
    with pytest.raises(ConfigError, match="critic.policy_lam"):
        _cfg("critic.policy_lam=adaptve")
    with pytest.raises(ConfigError, match="critic.mode"):
        _cfg("critic.mode=tied")


# --- GAE targets by hand -------------------------------------------------------------


def test_decoupled_gae_by_hand_skips_tool_tokens() -> None:
    # one response, token 1 is tool output (mask 0; its value 9 must be ignored), reward 1
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    values = torch.tensor([[0.2, 9.0, 0.4, 0.5]])
    rewards = torch.tensor([1.0])
    zeros = torch.zeros(1, 4)
    cfg = _cfg("critic.policy_lam=0.5", "critic.lam=1.0", "critic.whiten=false")
    t = gae_targets(cfg, rewards, mask, values, zeros, None)
    # policy chain t0 -> t2 -> t3, lambda 0.5:
    #   t3: delta = 1 - 0.5 = 0.5                         A = 0.5
    #   t2: delta = 0.5 - 0.4 = 0.1                       A = 0.1 + 0.5 * 0.5 = 0.35
    #   t0: delta = 0.4 - 0.2 = 0.2 (skips the tool token) A = 0.2 + 0.5 * 0.35 = 0.375
    torch.testing.assert_close(t.advantages, torch.tensor([[0.375, 0.0, 0.35, 0.5]]))
    # critic lambda 1 (gamma 1): the Monte-Carlo return, the reward on every policy token
    torch.testing.assert_close(t.returns, torch.tensor([[1.0, 0.0, 1.0, 1.0]]))
    torch.testing.assert_close(t.returns, mc_returns(rewards, mask))
    # no decoupling: the critic's targets are the policy's lambda-returns A + V
    coupled = gae_targets(_cfg("critic.policy_lam=0.5", "critic.whiten=false"), rewards, mask,
                          values, zeros, None)  # fmt: skip
    torch.testing.assert_close(coupled.returns, torch.tensor([[0.575, 0.0, 0.75, 1.0]]))
    torch.testing.assert_close(coupled.advantages, t.advantages)


def test_length_adaptive_lambda_is_used_per_response() -> None:
    # lengths 40 and 25 at alpha 0.05: lambda = 1 - 1/2 = 0.5 and 1 - 1/1.25 = 0.2
    mask = torch.zeros(2, 40)
    mask[0, :] = 1
    mask[1, :25] = 1
    cfg = _cfg("critic.policy_lam=adaptive", "critic.lam_alpha=0.05", "critic.lam=1.0",
               "critic.whiten=false")  # fmt: skip
    values = torch.zeros(2, 40)  # V = 0: A_t = lambda^(L-1-t) * r
    t = gae_targets(cfg, torch.tensor([1.0, 1.0]), mask, values, torch.zeros(2, 40), None)
    torch.testing.assert_close(t.policy_lam, torch.tensor([0.5, 0.2]))
    torch.testing.assert_close(t.advantages[0, 37:], torch.tensor([0.25, 0.5, 1.0]))
    torch.testing.assert_close(t.advantages[1, 22:26], torch.tensor([0.04, 0.2, 1.0, 0.0]))
    torch.testing.assert_close(t.returns, mask)  # Monte-Carlo returns, whatever lambda_policy
    # short responses (alpha * l <= 1) get lam_min
    short = torch.ones(1, 20)
    lam = policy_lambda(_cfg("critic.policy_lam=adaptive", "critic.lam_min=0.1").critic, short)
    torch.testing.assert_close(lam, torch.tensor([0.1]))


def test_lam_min_at_or_above_the_upper_clamp_is_refused_by_the_config() -> None:
    from anchor_rl.algos.gae import LAMBDA_MAX
    from anchor_rl.methods.critic_config import LAMBDA_MAX as CONFIG_MAX

    assert CONFIG_MAX == LAMBDA_MAX  # written out twice (the config imports no torch)
    with pytest.raises(ConfigError, match="critic.lam_min"):
        load_config("vapo", [f"critic.lam_min={(1 + LAMBDA_MAX) / 2}"])
    load_config("vapo", ["critic.lam_min=0.99"])


def test_pretraining_targets_are_the_rl_critics_under_a_discount() -> None:
    """With advantage.gamma < 1 value pretraining fits the returns the RL stage's critic
    regresses on (lambda = 1), not the undiscounted reward."""
    cfg = _cfg("advantage.gamma=0.9", "critic.lam=1.0")
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    rewards = torch.tensor([1.0])
    t = gae_targets(cfg, rewards, mask, torch.rand(1, 4), torch.zeros(1, 4), None)
    torch.testing.assert_close(mc_returns(rewards, mask, cfg.advantage.gamma), t.returns)


def test_monte_carlo_returns_are_exact_whatever_the_values() -> None:
    # lambda = gamma = 1: the returns are the reward-to-go, bit for bit, so a batch without a
    # correct response has returns exactly 0 and an undefined (NaN) explained variance
    mask = torch.ones(3, 7)
    values = torch.rand(3, 7, generator=torch.Generator().manual_seed(1))
    t = gae_targets(_cfg("critic.lam=1.0"), torch.zeros(3), mask, values, torch.zeros(3, 7), None)
    assert torch.equal(t.returns, torch.zeros(3, 7))
    metrics = critic_metrics(t.values, t.returns, t.advantages, t.policy_lam, mask, torch.zeros(3))
    assert math.isnan(metrics["critic/explained_variance"])


def test_whitened_advantages_have_zero_mean_unit_std_on_policy_tokens() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    values = torch.tensor([[0.1, 0.3, 0.0], [0.6, 0.0, 0.0]])
    t = gae_targets(_cfg(), torch.tensor([1.0, 0.0]), mask, values, torch.zeros(2, 3), None)
    kept = t.advantages[mask > 0]
    assert abs(kept.mean().item()) < 1e-6 and abs(kept.std().item() - 1.0) < 1e-5
    assert t.advantages[mask == 0].abs().sum() == 0


def test_kl_in_reward_enters_the_token_rewards() -> None:
    mask = torch.ones(1, 2)
    old, ref = torch.tensor([[0.0, 0.0]]), torch.tensor([[-0.5, 0.0]])  # k1 = [0.5, 0]
    cfg = _cfg("kl.coef=0.2", "kl.kind=k1", "kl.in_reward=true", "critic.whiten=false",
               "critic.policy_lam=1.0", "critic.lam=1.0")  # fmt: skip
    t = gae_targets(cfg, torch.tensor([1.0]), mask, torch.zeros(1, 2), old, ref)
    # token rewards [-0.1, 1]: reward-to-go [0.9, 1]
    torch.testing.assert_close(t.returns, torch.tensor([[0.9, 1.0]]))
    with pytest.raises(ValueError, match="reference log-probs"):
        gae_targets(cfg, torch.tensor([1.0]), mask, torch.zeros(1, 2), old, None)


# --- the critic's advantages reach the loss ------------------------------------------


def test_critic_advantages_come_from_the_critic_values_with_tool_tokens(policy) -> None:
    cfg = _cfg("critic.policy_lam=0.5", "critic.lam=1.0", "critic.whiten=false")
    batch = _toy_batch([[5, 6], [7]], [[10, 11, 12, 13], [14, 15]], [[1, 0, 1, 1], [1, 1]])
    component = _component(cfg, policy)
    with torch.no_grad():
        component.critic.head.weight.normal_(0, 0.3)  # non-zero values
    values = critic_values(component.critic, batch, cfg)
    assert values[0, 1] != 0  # the tool token has a value, which GAE must skip
    rewards = torch.tensor([1.0, 0.0])
    records = [Record("a", "p", "x"), Record("b", "q", "y")]
    step = Step(1, Scored(batch, records, rewards, rewards, rewards > 0), {}, Timer())
    step.mask = mask = batch.loss_mask
    step.inputs = base_inputs(cfg, rewards, batch.group, mask, torch.zeros(2, 4), None)
    step.inputs |= component.advantage_inputs(step)
    step.advantages = compute_advantages(cfg, step.inputs)
    component.on_advantages(step)
    adv = step.advantages
    v = values[0]
    a3 = 1.0 - v[3]
    a2 = v[3] - v[2] + 0.5 * a3
    a0 = v[2] - v[0] + 0.5 * a2  # bootstraps from the next *policy* token's value
    torch.testing.assert_close(adv[0], torch.stack([a0, torch.tensor(0.0), a2, a3]))
    assert adv[1, 2:].abs().sum() == 0
    assert {"critic/loss", "critic/explained_variance", "critic/first_token_error",
            "advantage/len_q0/mean"} <= set(step.metrics)  # fmt: skip


def test_train_step_passes_the_gae_advantages_to_the_policy_update(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    seen = {}
    real_targets, real_update = critic_mod.critic_targets, loop_mod.ppo_update

    def spy_targets(*args, **kwargs):
        seen["targets"] = real_targets(*args, **kwargs)
        return seen["targets"]

    def spy_update(model, optimizer, scheduler, batch, mask, old, ref, adv, *rest, **kwargs):
        seen["adv"], seen["mask"] = adv, mask
        return real_update(model, optimizer, scheduler, batch, mask, old, ref, adv, *rest, **kwargs)

    monkeypatch.setattr(critic_mod, "critic_targets", spy_targets)
    monkeypatch.setattr(loop_mod, "ppo_update", spy_update)
    run = start_run(_cfg(*tiny, "steps=1", "eval.every=0"), tmp_path / "run")
    metrics = loop_mod.train_step(run)
    assert seen["adv"] is seen["targets"][0]
    assert seen["adv"][seen["mask"] == 0].abs().sum() == 0
    assert seen["adv"].abs().sum() > 0 and metrics["loss/policy"] != 0


# --- each VAPO knob switches off on its own -----------------------------------------

KNOBS = {
    # technique: (override that switches it off, the one field it changes)
    "value pretraining": ("critic.pretrain_steps=0", ("critic", "pretrain_steps", 0)),
    "decoupled GAE": ("critic.lam=policy", ("critic", "lam", "policy")),
    "length-adaptive GAE": ("critic.policy_lam=0.95", ("critic", "policy_lam", 0.95)),
    "clip-higher": ("loss.clip_high=0.2", ("loss", "clip_high", 0.2)),
    "token-level loss": ("loss.agg=seq-mean-token-mean", ("loss", "agg", "seq-mean-token-mean")),
    "NLL on correct samples": ("loss.nll_coef=0", ("loss", "nll_coef", 0.0)),
}


@pytest.mark.parametrize("knob", KNOBS)
def test_each_knob_changes_only_its_field(knob: str) -> None:
    override, (section, field, value) = KNOBS[knob]
    vapo, off = _cfg(preset="vapo"), _cfg(override, preset="vapo")
    assert getattr(getattr(off, section), field) == value != getattr(getattr(vapo, section), field)
    assert (
        off.model_dump()
        == vapo.model_copy(
            update={section: getattr(vapo, section).model_copy(update={field: value})}
        ).model_dump()
    )


def test_group_sampling_knob_resplits_the_same_rollouts() -> None:
    vapo = _cfg(preset="vapo")
    off = _cfg("rollout.prompts_per_step=16", "rollout.n=4", preset="vapo")
    assert (vapo.rollout.prompts_per_step, vapo.rollout.n) == (4, 16)
    assert off.rollout.prompts_per_step * off.rollout.n == 64 == vapo.rollout.prompts_per_step * 16


def test_critic_knobs_change_the_targets() -> None:
    mask = torch.zeros(2, 40)
    mask[0, :] = 1
    mask[1, :30] = 1
    values, rewards = torch.rand(2, 40, generator=torch.Generator().manual_seed(0)), torch.ones(2)
    zeros = torch.zeros(2, 40)
    vapo = gae_targets(_cfg(preset="vapo"), rewards, mask, values * mask, zeros, None)
    torch.testing.assert_close(vapo.returns, mask)  # decoupled: MC returns
    assert vapo.policy_lam.tolist() == pytest.approx([0.5, 1 - 1 / 1.5])
    coupled = gae_targets(_cfg("critic.lam=policy", preset="vapo"), rewards, mask, values * mask,
                          zeros, None)  # fmt: skip
    assert not torch.allclose(coupled.returns, mask)  # lambda-returns of the adaptive lambda
    fixed = gae_targets(_cfg("critic.policy_lam=0.95", preset="vapo"), rewards, mask,
                        values * mask, zeros, None)  # fmt: skip
    assert fixed.policy_lam.tolist() == pytest.approx([0.95, 0.95])
    torch.testing.assert_close(fixed.returns, mask)  # still decoupled


def test_loss_knobs_change_the_loss() -> None:
    # two responses of 1 and 3 tokens; ratio exp(log 1.25) = 1.25 on every token, A = 1
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[2.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    correct = torch.tensor([True, False])

    def terms(*overrides: str):
        logp = torch.full((2, 3), math.log(1.25), requires_grad=True)
        cfg = _cfg(*overrides, preset="vapo")
        out, _ = loss_terms(logp, old, None, adv, mask, correct, cfg)
        return out, logp, cfg

    vapo, logp, cfg = terms()
    # clip-higher 0.28: ratio 1.25 is inside the clip, so the policy term has gradient
    vapo["policy"].backward(retain_graph=True)
    assert logp.grad.abs().sum() > 0
    clipped, logp_c, _ = terms("loss.clip_high=0.2")
    clipped["policy"].backward()
    assert logp_c.grad.abs().sum() == 0  # ratio 1.25 > 1.2 clipped: no gradient
    # token-mean: -(2 + 1 + 1 + 1) * 1.25 / 4; sample-level: -(2 * 1.25 + 1.25) / 2
    assert vapo["policy"].item() == pytest.approx(-5 * 1.25 / 4)
    sample, _, _ = terms("loss.agg=seq-mean-token-mean")
    assert sample["policy"].item() == pytest.approx(-(2.5 + 1.25) / 2)
    # NLL on the correct response only: 0.1 * -log 1.25
    assert vapo["nll"].item() == pytest.approx(-0.1 * math.log(1.25))
    assert "nll" in loss_weights(mask, correct, cfg)
    no_nll, _, cfg_off = terms("loss.nll_coef=0")
    assert "nll" not in no_nll and "nll" not in loss_weights(mask, correct, cfg_off)


def test_pretraining_knob(parity, tiny, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(critic_mod, "pretrain_critic", _fail)
    run = start_run(_cfg(*tiny, "critic.pretrain_steps=0", preset="vapo"), tmp_path / "off")
    assert run.components["critic"].critic.head.weight.abs().sum() == 0  # fresh head
    assert not (run.run_dir / PRETRAIN_FILE).exists()
    with pytest.raises(AssertionError, match="pretraining ran"):
        start_run(_cfg(*tiny, "critic.pretrain_steps=2", preset="vapo"), tmp_path / "on")


def _fail(*args, **kwargs):
    raise AssertionError("pretraining ran")


def test_pretraining_fits_the_tokens_the_rl_stage_fits(monkeypatch) -> None:
    """Under loss.mask_truncated a truncated response is out of the RL stage's value loss,
    so it is out of pretraining's too; the setting is in the cache key."""
    from types import SimpleNamespace

    seen = {}

    def capture(cache_dir, key, build, sample_fn, *args, **kwargs):
        seen.update(key=key, sampled=sample_fn(0))
        raise AssertionError("captured")

    batch = _toy_batch([[5], [6]], [[10, 11], [12, 13]], [[1, 1], [1, 1]])
    batch.truncated = torch.tensor([True, False])
    monkeypatch.setattr(critic_mod, "generate", lambda *args, **kwargs: batch)
    rewards = SimpleNamespace(rewards=torch.tensor([0.0, 1.0]))
    monkeypatch.setattr(critic_mod, "score", lambda *args, **kwargs: rewards)
    monkeypatch.setattr(critic_mod, "pretrain_value_cached", capture)
    cfg = _cfg("critic.pretrain_steps=2", "loss.mask_truncated=true", preset="vapo")
    with pytest.raises(AssertionError, match="captured"):
        model = build_model("tiny", build_tokenizer(), seed=0)
        critic_mod.pretrain_critic(cfg, model, None, get_task("arithmetic"))
    fitted, got = seen["sampled"]
    assert fitted.loss_mask.tolist() == [[0.0, 0.0], [1.0, 1.0]] and torch.equal(
        got, rewards.rewards
    )
    assert seen["key"]["mask_truncated"] is True


def test_pretraining_fits_a_critic_without_dropout_to_the_runs_discount(monkeypatch) -> None:
    """The critic pretrained is the one the RL stage trains (dropout off unless
    disable_dropout=false), on the run's discount; both are in the cache key."""
    seen = {}

    def capture(cache_dir, key, build, *args, **kwargs):
        seen.update(key=key, critic=build(), gamma=kwargs["gamma"])
        raise AssertionError("captured")

    monkeypatch.setattr(critic_mod, "pretrain_value_cached", capture)
    dropping = build_model("tiny", build_tokenizer(), seed=0)
    for layer in dropping.model.layers:
        layer.self_attn.attention_dropout = 0.1
    for overrides, off in ((["critic.pretrain_steps=2"], True),
                           (["critic.pretrain_steps=2", "disable_dropout=false"], False)):  # fmt: skip
        cfg = _cfg(*overrides, "advantage.gamma=0.9", preset="vapo")
        with pytest.raises(AssertionError, match="captured"):
            critic_mod.pretrain_critic(cfg, dropping, None, get_task("arithmetic"))
        rates = {
            m.attention_dropout for m in seen["critic"].modules() if hasattr(m, "attention_dropout")
        }
        assert rates == ({0.0} if off else {0.1})
        assert seen["gamma"] == 0.9 and seen["key"]["disable_dropout"] is off


# --- the critic's update -------------------------------------------------------------


def test_critic_update_steps_the_optimizer_and_lowers_the_value_loss(policy) -> None:
    cfg = _cfg("critic.lr=3e-3", "critic.lam=1.0", "optim.epochs=2", "optim.micro_batch_size=1")
    batch = _toy_batch(
        [[5, 6], [7], [8, 9], [10]],
        [[10, 11, 12], [14, 15], [16, 17, 18], [19]],
        [[1, 0, 1], [1, 1], [1, 1, 1], [1]],
    )
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])
    c = new_critic(cfg, policy)
    optimizer = critic_optimizer(cfg, c)
    before = {k: v.clone() for k, v in c.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    mask = batch.loss_mask
    targets_0 = gae_targets(cfg, rewards, mask, torch.zeros(4, 3), torch.zeros(4, 3), None)
    losses = []
    for _ in range(15):
        t = gae_targets(cfg, rewards, mask, critic_values(c, batch, cfg), torch.zeros(4, 3), None)
        metrics = critic_update(c, optimizer, batch, mask, t.values, t.returns, cfg, generator)
        losses.append(metrics["critic/loss"])
    # V = 0 at first, Monte-Carlo returns (lambda 1), 5 of the 8 policy tokens have return 1:
    # 0.5 * mean(R^2) = 0.3125
    c0 = new_critic(cfg, policy)
    first = critic_update(c0, critic_optimizer(cfg, c0), batch, mask, targets_0.values,
                          targets_0.returns, _cfg("critic.lam=1.0"), generator)  # fmt: skip
    assert first["critic/loss"] == pytest.approx(0.3125)
    assert losses[-1] < 0.5 * losses[0]
    assert all(not torch.equal(before[k], v) for k, v in c.state_dict().items() if "head" in k)
    assert len(optimizer.state) > 0 and metrics["critic/lr"] == 3e-3


def test_shared_critic_trains_its_head_only(policy) -> None:
    cfg = _cfg("critic.mode=shared", "critic.lr=1e-2")
    c = new_critic(cfg, policy)
    batch = _toy_batch([[5]], [[10, 11]], [[1, 1]])
    body = {k: v.clone() for k, v in policy.state_dict().items()}
    t = gae_targets(cfg, torch.tensor([1.0]), batch.loss_mask, critic_values(c, batch, cfg),
                    torch.zeros(1, 2), None)  # fmt: skip
    critic_update(c, critic_optimizer(cfg, c), batch, batch.loss_mask, t.values, t.returns, cfg,
                  torch.Generator())  # fmt: skip
    assert c.head.bias.item() != 0
    assert all(torch.equal(body[k], v) for k, v in policy.state_dict().items())


# --- end to end, checkpoint and resume ------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["ppo", "vapo"])
def test_preset_runs_one_step_end_to_end(preset, parity, tiny, tmp_path) -> None:
    pretrain = ["critic.pretrain_steps=2"] if preset == "vapo" else []  # a couple of steps
    cfg = _cfg(*tiny, "steps=1", *pretrain, preset=preset)
    run = start_run(cfg, tmp_path / preset)
    pretrained_head = run.components["critic"].critic.head.weight.detach().clone()
    run = train(run)
    step = read_metrics(run.run_dir)[-1]
    assert {"critic/loss", "critic/explained_variance", "critic/value_mse", "critic/policy_lam",
            "critic/first_token_error", "advantage/len_q3/mean", "loss/policy"} <= set(step)  # fmt: skip
    assert ("loss/nll" in step) == (preset == "vapo")
    assert (latest_checkpoint(run.run_dir) / "critic.pt").is_file()
    pretrained = run.run_dir / PRETRAIN_FILE
    assert pretrained.is_file() == (preset == "vapo")
    if preset == "vapo":
        history = json.loads(pretrained.read_text())
        assert history["steps"] == 2 and not history["from_cache"]
        assert history["rollouts"] == 2 * 8
    # the reference rollouts value pretraining used count in the run's total
    assert step["rollouts/value_pretrain"] == (16 if preset == "vapo" else 0)
    assert step["rollouts/total"] == step["rollouts/cumulative"] + step["rollouts/value_pretrain"]
    assert "rollouts/presample" not in step  # the counters of components the run lacks
    if preset == "vapo":
        again = start_run(cfg, tmp_path / "again")  # same reference and settings: the cache
        assert json.loads((again.run_dir / PRETRAIN_FILE).read_text())["from_cache"]
        critic = again.components["critic"]
        assert critic.value_pretrain_rollouts == 16  # counted from the cache too
        assert torch.equal(critic.critic.head.weight, pretrained_head)
        assert pretrained_head.abs().sum() > 0


@pytest.mark.slow
def test_resume_restores_the_critic_and_reproduces_the_metrics(parity, tiny, tmp_path) -> None:
    overrides = [*tiny, "steps=4", "checkpoint.every=1", "checkpoint.keep=4", "eval.every=0",
                 "critic.pretrain_steps=2"]  # fmt: skip
    straight = train(start_run(_cfg(*overrides, preset="vapo"), tmp_path / "a"))
    half = train(start_run(_cfg(*overrides, "steps=2", preset="vapo"), tmp_path / "b"))
    saved = latest_checkpoint(half.run_dir)
    restored = _component(half.cfg, half.policy)
    load_components(saved, {"critic": restored})
    live = half.components["critic"]
    for key, value in live.critic.state_dict().items():
        assert torch.equal(value, restored.critic.state_dict()[key]), key
    assert _state_equal(live.optimizer.state_dict(), restored.optimizer.state_dict())
    resumed = train(resume_run(tmp_path / "b", {"steps": 4}))
    a, b = read_metrics(straight.run_dir), read_metrics(resumed.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b, strict=True):
        keys = {k for k in ra if not k.startswith("time/")}
        assert keys == {k for k in rb if not k.startswith("time/")}
        for k in keys:
            assert ra[k] == rb[k] or (math.isnan(ra[k]) and math.isnan(rb[k])), k
    for key, value in straight.components["critic"].critic.state_dict().items():
        assert torch.equal(value, resumed.components["critic"].critic.state_dict()[key]), key


def test_resume_without_a_saved_critic_fails_clearly(tmp_path, policy) -> None:
    with pytest.raises(FileNotFoundError, match="no state of the run's 'critic' component"):
        load_components(tmp_path, {"critic": _component(_cfg(), policy)})


def _state_equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_state_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_state_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    return a == b


# --- the bench suite -----------------------------------------------------------------


def test_vapo_suite_plans_ppo_vapo_and_each_ablation_at_equal_rollouts(tmp_path) -> None:
    from anchor_rl.bench.runner import load_suite, plan

    suite = load_suite("vapo")
    specs = plan(suite, tmp_path)
    # the cells without value pretraining have a copy run to the common budget (VAPO's total)
    budget = ["ppo+budget", "vapo+no_value_pretraining_budget"]
    assert suite.budget == "max" and suite.to_budget == budget
    copies = [s for s in specs if s.to_budget]
    assert sorted({s.label for s in copies}) == budget
    for copy in copies:
        cell = next(s for s in specs if s.label == copy.label.removesuffix("_budget")
                    .removesuffix("+budget") and s.seed == copy.seed)  # fmt: skip
        mine, same = copy.config.model_dump(), cell.config.model_dump()
        mine.pop("budget"), same.pop("budget")
        assert mine == same and copy.config.budget.rollouts is not None, copy.label
    specs = [s for s in specs if not s.to_budget]
    labels = sorted({s.label for s in specs})
    assert labels == sorted(
        ["ppo", "vapo", "vapo+length_matched"]
        + [
            f"vapo+no_{k}"
            for k in (
                "value_pretraining",
                "decoupled_gae",
                "length_adaptive_gae",
                "clip_higher",
                "token_mean",
                "nll",
                "group_sampling",
            )
        ]  # fmt: skip
    )
    assert len(specs) == 30 and {s.seed for s in specs} == {0, 1, 2}
    assert {s.config.rollout.prompts_per_step * s.config.rollout.n for s in specs} == {64}
    by = {(s.label, s.seed): s.config.model_dump() for s in specs}
    vapo = by[("vapo", 0)]
    for label in labels:
        if label.startswith("vapo+"):
            changed = {
                (section, key)
                for section, table in by[(label, 0)].items()
                if isinstance(table, dict)
                for key in table
                if table[key] != vapo[section][key]
            }
            # one knob each; group sampling re-splits prompts x samples
            assert len(changed) == (2 if label.endswith("group_sampling") else 1), label
    # the length-matched alpha: lambda_policy = 1 - 1 / (alpha * 27) = 0.98 at ~27 tokens
    alpha = by[("vapo+length_matched", 0)]["critic"]["lam_alpha"]
    assert (
        1 - 1 / (alpha * 27) == pytest.approx(0.98, abs=1e-3)
        and vapo["critic"]["lam_alpha"] == 0.05
    )
    quick = plan(load_suite("vapo"), tmp_path, seeds=[0], profile="quick")
    assert all(s.config.model == "random:tiny" for s in quick)
