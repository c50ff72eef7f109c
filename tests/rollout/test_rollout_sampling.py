"""sample_next on hand-made distributions: greedy, top-p nucleus, log-probs, seeding."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.rollout.sampling import EOS, StopSet, sample_next, uniforms

LOGITS = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))


def _u(rows: int, seed: int) -> torch.Tensor:
    """One uniform per row, from the counter-based generator (seed, row)."""
    return torch.from_numpy(uniforms([seed] * rows, range(rows)))


def test_greedy_picks_argmax_with_logprob_zero():
    tokens, logp = sample_next(torch.tensor([[0.1, 2.0, -1.0], [3.0, 0.0, 0.0]]), 0.0, 1.0)
    assert tokens.tolist() == [1, 0]
    assert logp.tolist() == [0.0, 0.0]


def test_top_p_keeps_the_nucleus_and_renormalises():
    tokens, logp = sample_next(LOGITS.expand(2000, 3), 1.0, 0.6, _u(2000, 0))
    assert set(tokens.tolist()) == {0, 1}  # 0.5 < 0.6, so token 1 joins; 0.8 >= 0.6 stops
    expected = {0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}
    for t, lp in zip(tokens.tolist(), logp.tolist(), strict=True):
        assert abs(lp - expected[t]) < 1e-5
    share = (tokens == 0).float().mean().item()
    assert abs(share - 0.625) < 0.05


def test_top_p_below_the_top_mass_keeps_one_token():
    tokens, logp = sample_next(LOGITS.expand(50, 3), 1.0, 0.45, _u(50, 1))
    assert tokens.tolist() == [0] * 50
    assert torch.allclose(logp, torch.zeros(50), atol=1e-6)


def test_temperature_logprob_is_under_the_scaled_distribution():
    tokens, logp = sample_next(LOGITS.expand(20, 3), 2.0, 1.0, _u(20, 2))
    scaled = torch.log_softmax(LOGITS[0] / 2.0, dim=-1)
    assert torch.allclose(logp, scaled[tokens], atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.floats(0.3, 2.0), top_p=st.floats(0.05, 1.0))
def test_same_seed_same_samples(seed, temperature, top_p):
    logits = torch.randn(8, 11, generator=torch.Generator().manual_seed(seed))
    a = sample_next(logits, temperature, top_p, _u(8, seed))
    b = sample_next(logits, temperature, top_p, _u(8, seed))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[1] <= 0).all()


class _CountingDecoder:
    """The tokenizer's ``decode``, counted."""

    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def decode(self, ids):
        self.calls += 1
        return self.tokenizer.decode(ids)


def _chars(tokenizer, text):
    """``text`` spelled one character a token (the built-in tokenizer has them all)."""
    return [tokenizer.convert_tokens_to_ids(c) for c in text]


def test_stop_set_decodes_only_after_tokens_that_can_complete_a_stop(tokenizer):
    stops = StopSet.build(tokenizer, ["</answer>", "\n\n", "</answer>"], [tokenizer.eos_token_id])
    assert stops.strings == ("</answer>", "\n\n") and stops.eos == {tokenizer.eos_token_id}
    answer, digit = tokenizer.convert_tokens_to_ids(["</answer>", "7"])
    assert answer not in stops.quiet and digit in stops.quiet
    assert tokenizer.convert_tokens_to_ids("\n") not in stops.quiet
    counting = _CountingDecoder(tokenizer)
    assert stops.match(counting, [digit, digit]) is None and counting.calls == 0
    assert stops.match(counting, [digit, answer]) == "</answer>" and counting.calls == 1
    assert stops.match(counting, [digit, tokenizer.eos_token_id]) == EOS
    assert StopSet.build(tokenizer, [], [tokenizer.eos_token_id]).match(counting, [answer]) is None


def test_a_stop_matches_on_text_whatever_the_tokens(tokenizer):
    """As an OpenAI-compatible server: a one-token stop spelled by several tokens stops,
    and so does a stop inside a longer token's text."""
    stops = StopSet.build(tokenizer, ["</answer>"], [tokenizer.eos_token_id])
    spelled = _chars(tokenizer, "12</answer>")
    assert len(spelled) == 11
    assert [stops.match(tokenizer, spelled[:k]) for k in range(1, 12)] == [None] * 10 + [
        "</answer>"
    ]
    tagged = tokenizer.encode("12</answer>", add_special_tokens=False)
    assert len(tagged) == 3  # the tag is one token
    assert stops.match(tokenizer, tagged) == "</answer>"
    assert StopSet.build(tokenizer, [">"], []).match(tokenizer, tagged) == ">"


def test_the_stop_that_starts_first_wins_whatever_their_order(tokenizer):
    ids = tokenizer.encode("533=</answer>", add_special_tokens=False)
    for order in (["wer>", "</ans"], ["</ans", "wer>"]):
        assert StopSet.build(tokenizer, order, []).match(tokenizer, ids) == "</ans"


def test_a_string_stop_of_many_bytes_is_found_when_its_tokens_are_bytes():
    """A byte-level tokenizer spends four tokens on a four-byte character: the tail the
    check decodes must hold the stop's bytes, not only its characters, and the tokens of an
    unfinished character are not quiet. A one-token stop inside a merged token stops too
    (``"\\n"`` inside ``"\\n\\n"``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(["hello world\n\n"] * 10, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=alphabet, special_tokens=["<eos>"]))  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    stop = "\N{SLIGHTLY SMILING FACE}"
    assert len(tok.encode(stop, add_special_tokens=False)) == 4
    stops = StopSet.build(tok, [stop], [tok.eos_token_id])
    ids = tok.encode("hello " + stop, add_special_tokens=False)
    assert stops.string_stop(tok, ids) == stop
    assert stops.string_stop(tok, ids[:-1]) is None
    assert [stops.match(tok, ids[:k]) for k in range(len(ids) - 3, len(ids) + 1)] == [None] * 3 + [
        stop
    ]
    newline = tok.encode("\n", add_special_tokens=False)
    merged = tok.encode("world\n\n", add_special_tokens=False)
    assert len(newline) == 1 and newline[0] not in merged  # "\n\n" is one token of its own
    assert StopSet.build(tok, ["\n"], []).match(tok, merged) == "\n"


def test_uniforms_are_a_pure_function_of_seed_and_counter():
    a = uniforms([1, 2, 3], [0, 0, 5])
    assert a.tolist() == uniforms([1, 2, 3], [0, 0, 5]).tolist()
    assert uniforms([3], [5]).tolist() == [a[2]]  # the same pair, alone or in a batch
    many = uniforms([7] * 20000, range(20000))
    assert ((many >= 0) & (many < 1)).all()
    assert abs(many.mean() - 0.5) < 0.01 and abs((many < 0.1).mean() - 0.1) < 0.01
    assert uniforms([2**64 - 1], [2**40]).shape == (1,)  # wraps, never overflows


def test_inverse_cdf_follows_the_distribution_and_never_picks_a_zero_mass_token():
    logits = torch.log(torch.tensor([[0.0, 0.5, 0.3, 0.2, 0.0]]))  # -inf at both ends
    tokens, logp = sample_next(logits.expand(20000, 5), 1.0, 1.0, _u(20000, 3))
    counts = torch.bincount(tokens, minlength=5).float() / 20000
    assert counts[0] == 0 and counts[4] == 0
    assert torch.allclose(counts[1:4], torch.tensor([0.5, 0.3, 0.2]), atol=0.015)
    edge = sample_next(logits, 1.0, 1.0, torch.tensor([1.0 - 2.0**-53]))[0]
    assert edge.tolist() == [3]  # u next to 1: the last token with positive mass
    with pytest.raises(ValueError, match="uniform"):
        sample_next(logits, 1.0, 1.0, None)
