"""Model sizes, seeding, and a save/reload round trip through the Auto classes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from anchor_rl.errors import AnchorRLError
from anchor_rl.models.factory import SIZES, build_model, model_config, num_parameters
from anchor_rl.models.loading import load_policy, save_policy
from anchor_rl.models.tokenizer import build_tokenizer, encode_prompt

TOK = build_tokenizer()


@pytest.mark.parametrize(
    ("size", "low", "high"), [("tiny", 0.8e6, 1.3e6), ("small", 8e6, 12e6), ("base", 40e6, 60e6)]
)
def test_named_sizes_have_their_parameter_counts(size, low, high):
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config(size, TOK))
    assert model.config.tie_word_embeddings
    assert low <= num_parameters(model) <= high


def test_unknown_size_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown model size 'huge'"):
        model_config("huge", TOK)
    assert set(SIZES) == {"tiny", "small", "base"}


def test_seed_fixes_the_initialisation():
    a, b, c = (build_model("tiny", TOK, seed=s) for s in (1, 1, 2))
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert a.lm_head.weight is a.model.embed_tokens.weight


def test_save_and_reload_give_identical_ids_and_logits(tmp_path):
    model = build_model("tiny", TOK, seed=3).eval()
    save_policy(model, TOK, tmp_path / "m")
    reloaded, tok = load_policy(tmp_path / "m")
    assert isinstance(AutoModelForCausalLM.from_pretrained(tmp_path / "m"), LlamaForCausalLM)
    text = "<search>who wrote it?</search><result>doc</result>\n<answer>A b-c 12</answer>"
    assert tok.encode(text) == TOK.encode(text)
    assert tok.decode(tok.encode(text)) == text
    prompt = encode_prompt(tok, "7*6=?", "Answer.")
    assert prompt == encode_prompt(TOK, "7*6=?", "Answer.")
    assert (tok.pad_token_id, tok.eos_token_id) == (TOK.pad_token_id, TOK.eos_token_id)
    ids = torch.tensor([prompt + tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reloaded(ids).logits)


def test_load_policy_rejects_a_non_model_directory(tmp_path):
    with pytest.raises(AnchorRLError, match="no config.json"):
        load_policy(tmp_path)
