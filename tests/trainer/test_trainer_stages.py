"""The advantage and update stages on hand-worked batches (no task, no generation)."""

from __future__ import annotations

import pytest
import torch

from anchor_rl.batch import RolloutBatch
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.advantage import advantage_metrics, base_inputs, compute_advantages
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.update import _accumulate, loss_mask, ppo_update, score_logprobs, token_mean

MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
INDEX = torch.tensor([0, 0, 1, 1])


def _advantages(cfg, rewards, index, mask, logp, ref_logp, **extra):
    """Stage 5 on the loop's inputs (plus any component inputs in ``extra``)."""
    return compute_advantages(cfg, base_inputs(cfg, rewards, index, mask, logp, ref_logp) | extra)


def test_grpo_advantage_by_hand() -> None:
    cfg = load_config("grpo")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = _advantages(cfg, rewards, INDEX, MASK, torch.zeros(4, 3), torch.zeros(4, 3))
    # group 0: mean 0.5, unbiased std sqrt(0.5): +-0.5 / 0.70711 = +-0.70711; group 1: all equal -> 0
    a = 0.5 / (0.5**0.5 + 1e-6)
    expected = torch.tensor([[a, a, 0.0], [-a, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    m = advantage_metrics(adv, MASK)
    assert m["advantage/zero_frac"] == 0.5
    assert m["advantage/mean"] == pytest.approx(0.0, abs=1e-6)


def test_rloo_with_kl_in_the_sequence_reward_by_hand() -> None:
    cfg = load_config("rloo", ["kl.coef=0.5"])  # k1, in reward
    old = torch.zeros(4, 3)
    ref = torch.full((4, 3), -0.2)  # k1 = 0.2 per token
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    adv = _advantages(cfg, rewards, INDEX, MASK, old, ref)
    # sequence KL = 0.2 * tokens = [0.4, 0.2, 0.6, 0.2]; r' = r - 0.5 KL = [0.8, -0.1, 0.7, 0.9]
    # leave-one-out in groups of two: [0.9, -0.9, -0.2, 0.2]
    per_row = torch.tensor([0.9, -0.9, -0.2, 0.2])
    torch.testing.assert_close(adv, per_row[:, None] * MASK)


def test_reinforce_pp_with_kl_in_the_token_rewards_by_hand() -> None:
    cfg = load_config("reinforce_pp", ["kl.coef=0.5"])
    mask = MASK[:2]
    old, ref = torch.zeros(2, 3), torch.full((2, 3), -0.2)
    adv = _advantages(cfg, torch.tensor([1.0, 0.0]), INDEX[:2], mask, old, ref)
    # token rewards: row 0 [-0.1, 1 - 0.1], row 1 [0 - 0.1]; returns [0.8, 0.9], [-0.1]
    # whitened over the 3 tokens: mean 0.53333, unbiased std 0.55076
    expected = torch.tensor([[0.48418, 0.66575, 0.0], [-1.14993, 0.0, 0.0]])
    torch.testing.assert_close(adv, expected, atol=1e-4, rtol=0)


def test_token_mean_by_hand() -> None:
    values = torch.arange(12.0).reshape(4, 3)
    # masked entries: 0, 1 | 3 | 6, 7, 8 | 9 -> 34 / 7
    assert token_mean(values, MASK) == pytest.approx(34 / 7)
    assert token_mean(values, torch.zeros(4, 3)) == 0.0


def test_prompt_sampler_is_a_function_of_seed_and_cursor() -> None:
    records = [Record(str(i), f"p{i}", str(i)) for i in range(5)]
    a = PromptSampler(records, seed=3)
    first = [r.id for r in a.take(12)]
    assert sorted(first[:5]) == sorted(first[5:10]) == [str(i) for i in range(5)]  # epochs
    assert first[:5] != first[5:10]  # reshuffled each epoch (fixed seed: not equal by chance)
    b = PromptSampler(records, seed=3, consumed=7)
    assert [r.id for r in b.take(5)] == first[7:12]


# --- update -------------------------------------------------------------------------------


def _batch(b: int = 4, t: int = 5) -> RolloutBatch:
    gen = torch.Generator().manual_seed(0)
    lengths = [5, 2, 4, 1][:b]
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    mask[2, 1] = 0.0  # a tool token inside a response: attended to, no loss
    ids = torch.randint(20, 100, (b, t), generator=gen) * (mask > 0) + 0
    return RolloutBatch(
        group=torch.tensor([0, 0, 1, 1][:b]),
        prompt_ids=[[2, 30, 31], [2, 30, 31], [2, 40], [2, 40]][:b],
        response_ids=ids,
        attention_mask=(torch.arange(t) < torch.tensor(lengths)[:, None]).float(),
        loss_mask=mask,
        logprobs=torch.zeros(b, t),
        texts=[""] * b,
        tool_calls=torch.zeros(b, dtype=torch.long),
        truncated=torch.tensor([True, False, False, False][:b]),
        pad_id=0,
    )


def _model():
    return build_model("tiny", build_tokenizer(), seed=0)


def _grads(model, batch, cfg, adv, correct, ref) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    mask = loss_mask(batch, cfg)
    old, _ = score_logprobs(model, batch, cfg)
    _accumulate(model, batch, torch.arange(len(batch)), mask, old - 0.1, ref, adv, correct, cfg)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_micro_batches_accumulate_to_the_full_batch_gradient(agg: str) -> None:
    model, batch = _model(), _batch()
    base = [
        f"loss.agg={agg}",
        "kl.coef=0.1",
        "kl.in_reward=false",
        "loss.nll_coef=0.3",
        "loss.mask_truncated=true",
    ]
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * batch.loss_mask
    correct = torch.tensor([True, False, True, True])
    ref = torch.full(batch.loss_mask.shape, -4.0)
    full = _grads(model, batch, load_config("grpo", base), adv, correct, ref)
    micro = _grads(
        model, batch, load_config("grpo", [*base, "optim.micro_batch_size=1"]), adv, correct, ref
    )
    for g_full, g_micro in zip(full, micro, strict=True):
        torch.testing.assert_close(g_micro, g_full, atol=1e-6, rtol=1e-4)


def test_mask_truncated_drops_truncated_rows() -> None:
    batch = _batch()
    mask = loss_mask(batch, load_config("grpo", ["loss.mask_truncated=true"]))
    assert mask[0].sum() == 0 and torch.equal(mask[1:], batch.loss_mask[1:])


def test_ppo_update_steps_the_optimizer_and_reports_metrics() -> None:
    model, batch = _model(), _batch()
    cfg = load_config(
        "dapo", ["optim.epochs=2", "optim.mini_batches=2", "optim.lr=1e-3", "optim.warmup_steps=8"]
    )
    before = [p.detach().clone() for p in model.parameters()]
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8))
    mask = loss_mask(batch, cfg)
    old, _ = score_logprobs(model, batch, cfg)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])[:, None] * mask
    metrics = ppo_update(
        model, optimizer, scheduler, batch, mask, old, None, adv,
        torch.ones(4, dtype=torch.bool), cfg, torch.Generator().manual_seed(0),
    )  # fmt: skip
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    # 2 epochs x 2 mini-batches = 4 optimizer steps: lr = 1e-3 * min(1, (4 + 1) / 8)
    assert metrics["lr"] == pytest.approx(1e-3 * 5 / 8)
    for key in [
        "loss/policy",
        "loss/total",
        "grad_norm",
        "policy/clipfrac_low",
        "policy/clipfrac_high",
    ]:
        assert key in metrics
    assert "loss/kl" not in metrics  # DAPO has no KL term


def test_the_single_pass_update_equals_the_rescored_one() -> None:
    """optim.rescore=auto's single pass: the same losses, step and log-probs as recomputing
    the log-probs first, within 1e-6 (float32 on the CPU; here they are bit-equal or nearly)."""
    cfg = load_config("grpo", ["optim.lr=1e-3"])
    batch = _batch()
    mask = loss_mask(batch, cfg)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None] * mask
    correct = torch.tensor([True, False, True, False])
    results = []
    for single in (False, True):
        model, ref = _model(), build_model("tiny", build_tokenizer(), seed=1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
        logp, entropy = score_logprobs(model, batch, cfg, with_entropy=True)
        ref_logp, _ = score_logprobs(ref, batch, cfg)
        seen: dict = {}
        metrics = ppo_update(
            model, optimizer, scheduler, batch, mask, None if single else logp, ref_logp, adv,
            correct, cfg, torch.Generator().manual_seed(0), seen=seen,
        )  # fmt: skip
        results.append((metrics, [p.detach().clone() for p in model.parameters()], seen))
    (plain, plain_params, none), (fast, fast_params, seen) = results
    assert none == {} and set(seen) == {"logp", "entropy"}
    torch.testing.assert_close(seen["logp"], logp, atol=1e-6, rtol=0)
    torch.testing.assert_close(seen["entropy"], entropy, atol=1e-6, rtol=0)
    for key in ("loss/policy", "loss/kl", "loss/total", "grad_norm", "policy/ratio_mean"):
        assert fast[key] == pytest.approx(plain[key], abs=1e-6), key
    for a, b in zip(plain_params, fast_params, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="one step on the whole batch"):
        two = load_config("grpo", ["optim.mini_batches=2"])
        ppo_update(model, optimizer, scheduler, batch, mask, None, None, adv, correct, two,
                   torch.Generator().manual_seed(0))  # fmt: skip


def test_bf16_autocast_scores_and_updates_within_its_stated_tolerance() -> None:
    """optim.autocast=bf16: scoring runs the bf16 forward (its log-probs differ from float32's,
    so autocast is on) and stays within 5e-2 of float32 per token; the update's gradient
    points the way float32's does (cosine > 0.99) and parameters and gradients stay float32."""
    model, batch = _model(), _batch()
    fp32, bf16 = (
        load_config("grpo", ["kl.coef=0", *extra]) for extra in ([], ["optim.autocast=bf16"])
    )
    mask = batch.attention_mask.bool()
    lp32, _ = score_logprobs(model, batch, fp32)
    lp16, _ = score_logprobs(model, batch, bf16)
    assert lp16.dtype == torch.float32
    diff = (lp16 - lp32)[mask].abs()
    assert 0 < diff.max() < 5e-2
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2])[:, None] * batch.loss_mask
    correct = torch.tensor([True, False, True, True])
    g32, g16 = (
        torch.cat([g.flatten() for g in _grads(model, batch, cfg, adv, correct, None)])
        for cfg in (fp32, bf16)
    )
    assert g16.dtype == torch.float32
    assert not torch.equal(g16, g32)
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99
