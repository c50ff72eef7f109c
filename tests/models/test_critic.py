"""Critic: shapes and masks, the V(s_t) alignment, modes, save/load."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import response_batch
from transformers import LlamaConfig, LlamaForCausalLM

from anchor_rl.algos.losses import value_loss
from anchor_rl.batch import RolloutBatch
from anchor_rl.models.critic import Critic
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import save_policy
from anchor_rl.models.tokenizer import build_tokenizer

VOCAB = 32
PAD = 0


def tiny_policy(seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def make_batch(prompts: list[list[int]], responses: list[list[int]]) -> RolloutBatch:
    """Right-padded batch; every response token is a policy token."""
    return response_batch(prompts, responses, PAD)


def random_head(critic: Critic, seed: int = 1) -> Critic:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape, generator=g))
        critic.head.bias.fill_(0.25)
    return critic


PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]
RESPONSES = [[11, 12, 13, 14], [15, 16], [17, 18, 19, 20, 21, 22]]


@pytest.fixture(scope="module")
def policy() -> LlamaForCausalLM:
    return tiny_policy()


def test_fresh_critic_predicts_zero(policy):
    critic = Critic.from_causal_lm(policy)
    values = critic.values(make_batch(PROMPTS, RESPONSES))
    assert torch.equal(values, torch.zeros(3, 6))


def test_values_shape_and_mask(policy):
    critic = random_head(Critic.from_causal_lm(policy))
    batch = make_batch(PROMPTS, RESPONSES)
    values = critic.values(batch)
    assert values.shape == (3, 6) and values.dtype == torch.float32
    assert torch.all(values[batch.attention_mask == 0] == 0)
    assert torch.all(values[batch.attention_mask == 1] != 0)


def test_value_at_t_is_the_hidden_state_of_the_prefix_before_t(policy):
    """V(s_t) = head(h_last(prompt + response[:t])), computed row by row without padding."""
    critic = random_head(Critic.from_causal_lm(policy))
    values = critic.values(make_batch(PROMPTS, RESPONSES))
    with torch.no_grad():
        for b, (prompt, response) in enumerate(zip(PROMPTS, RESPONSES, strict=True)):
            for t in range(len(response)):
                prefix = torch.tensor([prompt + response[:t]])
                h = critic.backbone(input_ids=prefix).last_hidden_state[0, -1]
                assert values[b, t].item() == pytest.approx(critic.head(h).item(), abs=1e-5)


def test_changing_token_t_changes_only_later_values(policy):
    critic = random_head(Critic.from_causal_lm(policy))
    base = critic.values(make_batch(PROMPTS, RESPONSES))
    edited = [list(r) for r in RESPONSES]
    edited[0][2] = 30  # token t = 2 of row 0
    after = critic.values(make_batch(PROMPTS, edited))
    torch.testing.assert_close(after[0, :3], base[0, :3], rtol=0, atol=1e-6)  # V(s_0..s_2)
    assert (after[0, 3:4] - base[0, 3:4]).abs().item() > 1e-4  # V(s_3) sees token 2
    torch.testing.assert_close(after[1:], base[1:], rtol=0, atol=1e-6)  # other rows


@pytest.mark.parametrize("padding_free", [True, False])
def test_micro_batch_gives_the_same_values(policy, padding_free):
    """Packed and padded (a padded micro-batch cut to its own longest response)."""
    critic = random_head(Critic.from_causal_lm(policy))
    critic.padding_free = padding_free
    batch = make_batch(PROMPTS, RESPONSES)
    assert critic.layout(batch) == ("packed" if padding_free else "padded")
    torch.testing.assert_close(
        critic.values(batch, micro_batch=1), critic.values(batch), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_shared_and_packed_values_and_gradients_equal_the_padded_ones(policy, mode):
    """Groups that share a prompt (and an empty response): the shared-prefix and the packed
    forward give the padded layout's values and gradients within float rounding."""
    critic = random_head(Critic.from_causal_lm(policy, mode))
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    responses = [RESPONSES[0], RESPONSES[2], RESPONSES[1], [], [30]]
    batch = make_batch(prompts, responses)
    results = {}
    for padding_free, shared in ((True, True), (True, False), (False, False)):
        critic.padding_free, critic.shared_prefix = padding_free, shared
        kind = critic.layout(batch)
        values = critic.values(batch)
        (values**2).sum().backward()
        grads = [p.grad.clone() for p in critic.parameters()]
        results[kind] = values.detach(), grads
        critic.zero_grad(set_to_none=True)
    assert set(results) == {"shared", "packed", "padded"}
    b, b_grads = results["padded"]
    assert torch.all(b[batch.attention_mask == 0] == 0)
    for kind in ("shared", "packed"):
        a, a_grads = results[kind]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
        assert torch.all(a[batch.attention_mask == 0] == 0)
        # the squared loss on a random head sums ~0.2-sized gradients over many positions,
        # so rounding reaches ~3e-5 on single entries (a wrong mask moves values by > 1e-2)
        for x, y in zip(a_grads, b_grads, strict=True):
            torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-4)


def test_the_critic_picks_its_layout_per_pass_as_the_policy_does(policy):
    """On the CPU: shared prefixes where a prompt repeats, else packed; what is switched off
    is not used; a backbone that cannot pack (GPT-2) is read padded."""
    from transformers import GPT2Config, GPT2LMHeadModel

    critic = Critic.from_causal_lm(policy)
    repeated = make_batch([PROMPTS[0], PROMPTS[0]], RESPONSES[:2])
    distinct = make_batch(PROMPTS, RESPONSES)
    assert (critic.layout(repeated), critic.layout(distinct)) == ("shared", "packed")
    critic.shared_prefix = False
    assert critic.layout(repeated) == "packed"
    critic.padding_free = False
    assert critic.layout(repeated) == critic.layout(distinct) == "padded"
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=VOCAB))
    assert Critic.from_causal_lm(gpt2).layout(distinct) == "padded"


def test_separate_mode_owns_a_copy():
    policy = tiny_policy()
    critic = Critic.from_causal_lm(policy)
    own = {id(p) for p in critic.parameters()}
    assert own.isdisjoint({id(p) for p in policy.parameters()})
    n_body = len(list(policy.base_model.parameters()))
    assert len(own) == n_body + 2  # backbone copy + head weight and bias
    assert all(p.requires_grad for p in critic.parameters())

    random_head(critic)
    batch = make_batch(PROMPTS, RESPONSES)
    before = critic.values(batch)
    with torch.no_grad():  # a policy update does not touch the copy
        policy.model.norm.weight.mul_(2.0)
    torch.testing.assert_close(critic.values(batch), before, rtol=0, atol=0)


def test_shared_mode_trains_only_the_head():
    policy = tiny_policy()
    critic = random_head(Critic.from_causal_lm(policy, mode="shared"))
    assert critic.backbone is policy.base_model
    assert [id(p) for p in critic.parameters()] == [id(critic.head.weight), id(critic.head.bias)]
    assert set(critic.state_dict()) == {"head.weight", "head.bias"}

    batch = make_batch(PROMPTS, RESPONSES)
    values = critic.values(batch)
    loss, _ = value_loss(
        values, values.detach(), torch.ones_like(values), batch.loss_mask, clip=0.2
    )
    loss.backward()
    assert critic.head.weight.grad is not None and critic.head.weight.grad.abs().sum() > 0
    assert all(p.grad is None for p in policy.parameters())  # value loss never reaches the policy

    with torch.no_grad():  # a policy update is seen by the shared critic at once
        policy.model.norm.weight.mul_(2.0)
    assert not torch.allclose(critic.values(batch), values)


def test_shared_mode_needs_the_model_not_a_path(tmp_path):
    with pytest.raises(ValueError, match="live policy"):
        Critic.from_causal_lm(tmp_path, mode="shared")
    with pytest.raises(ValueError, match="unknown critic mode"):
        Critic(tiny_policy().base_model, mode="tied")  # type: ignore[arg-type]


def test_from_a_directory_equals_from_the_model(policy, tmp_path):
    policy.save_pretrained(tmp_path / "sft")
    from_dir = random_head(Critic.from_causal_lm(tmp_path / "sft"))
    from_model = random_head(Critic.from_causal_lm(policy))
    assert from_dir.base_path == str(tmp_path / "sft")
    batch = make_batch(PROMPTS, RESPONSES)
    torch.testing.assert_close(from_dir.values(batch), from_model.values(batch), rtol=0, atol=1e-6)


def test_empty_prompt_is_rejected(policy):
    critic = Critic.from_causal_lm(policy)
    with pytest.raises(ValueError, match="empty prompts"):
        critic.values(make_batch([[1], []], [[2], [3]]))


@pytest.mark.parametrize("mode", ["separate", "shared"])
def test_save_load_round_trip(mode, tmp_path):
    policy = tiny_policy()
    critic = random_head(Critic.from_causal_lm(policy, mode=mode))
    if mode == "separate":  # make the copy differ from the policy's body
        with torch.no_grad():
            critic.backbone.norm.weight.mul_(1.5)
    batch = make_batch(PROMPTS, RESPONSES)
    critic.save(tmp_path / "critic")

    config = json.loads((tmp_path / "critic" / "critic.json").read_text())
    assert config["mode"] == mode and config["hidden_size"] == 32
    assert (tmp_path / "critic" / "backbone").is_dir() == (mode == "separate")

    loaded = Critic.load(tmp_path / "critic", policy=policy)
    assert loaded.mode == mode
    torch.testing.assert_close(loaded.values(batch), critic.values(batch), rtol=0, atol=0)
    if mode == "shared":
        assert loaded.backbone is policy.base_model
        with pytest.raises(ValueError, match="pass policy="):
            Critic.load(tmp_path / "critic")


def test_project_tiny_model_round_trip(tmp_path):
    """The built-in tied-embedding model: SFT dir -> critic -> save -> load, values kept."""
    tokenizer = build_tokenizer()
    policy = build_model("tiny", tokenizer, seed=0)
    save_policy(policy, tokenizer, tmp_path / "sft")
    critic = random_head(Critic.from_causal_lm(tmp_path / "sft"))
    assert critic.head.in_features == policy.config.hidden_size
    batch = make_batch(PROMPTS, RESPONSES)
    reference = random_head(Critic.from_causal_lm(policy)).values(batch)
    torch.testing.assert_close(critic.values(batch), reference, rtol=0, atol=1e-5)
    critic.save(tmp_path / "critic")
    torch.testing.assert_close(
        Critic.load(tmp_path / "critic").values(batch), reference, rtol=0, atol=1e-5
    )
