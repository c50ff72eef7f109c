"""Priors: hand-worked predictions, forgetting, kNN neighbours, metrics, embeddings."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.anchors.priors import (
    PRIORS,
    AnchorPrior,
    HistoryPrior,
    KNNPrior,
    Prior,
    concordance_auc,
    ece,
    evaluate_prior,
    prior_metrics,
    prompt_embeddings,
)


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


# --- anchor -----------------------------------------------------------------------------


def test_anchor_predicts_mapping_and_global_mean_for_unknown():
    prior = AnchorPrior({"a": 0.2, "b": 0.6})
    assert torch.allclose(prior.predict(["b", "a", "zzz"]), t(0.6, 0.2, 0.4))
    prior.update(["a"], [t(1.0, 1.0)])  # static: nothing moves
    assert torch.allclose(prior.predict(["a"]), t(0.2))


def test_anchor_explicit_default_and_range_errors():
    assert torch.allclose(AnchorPrior({}, (-1.0, 1.0), default=0.0).predict(["x"]), t(0.0))
    with pytest.raises(ValueError, match="explicit default"):
        AnchorPrior({})
    with pytest.raises(ValueError, match="outside the reward range"):
        AnchorPrior({"a": 1.5})
    with pytest.raises(ValueError, match="lo < hi"):
        AnchorPrior({"a": 0.5}, reward_range=(1.0, 0.0))


def test_all_priors_satisfy_the_protocol():
    assert set(PRIORS) == {"anchor", "history", "knn"}
    for prior in (AnchorPrior({"a": 0.5}), HistoryPrior(), KNNPrior()):
        assert isinstance(prior, Prior)


# --- history ----------------------------------------------------------------------------


def test_history_beta_posterior_with_forgetting_hand_numbers():
    # strength 2 around 0.5 -> Beta(1, 1); gamma 0.5 per update call (training step).
    prior = HistoryPrior(strength=2.0, gamma=0.5)
    assert torch.allclose(prior.predict(["p"]), t(0.5))
    prior.update(["p"], [t(1, 1, 0, 1)])  # a = 3, b = 1 -> (1 + 3) / (2 + 4)
    assert torch.allclose(prior.predict(["p"]), t(4 / 6))
    prior.update(["q"], [t(0)])  # one step passes for p: counts halve to a = 1.5, b = 0.5
    assert torch.allclose(prior.predict(["p"]), t(2.5 / 4))
    prior.update(["q"], [t(0)])  # two steps since p was seen: a = 0.75, b = 0.25
    prior.update(["p"], [t(0, 0)])  # third step: a = 0.375, b = 0.125 + 2
    alpha, beta = prior.posterior(["p"])
    assert alpha.item() == pytest.approx(1.375) and beta.item() == pytest.approx(3.125)
    assert prior.predict(["p"]).item() == pytest.approx(1.375 / 4.5)


def test_history_rollouts_of_the_same_step_in_two_updates_equal_one_update():
    """``advance=False`` adds a batch to the step the last update began: two batches of one
    step, learned apart, leave the state one update with both would."""
    split, whole = HistoryPrior(gamma=0.5), HistoryPrior(gamma=0.5)
    for prior in (split, whole):
        prior.update(["p"], [t(1, 0)])
    split.update(["p", "q"], [t(1, 1), t(0)])
    split.update(["p"], [t(0, 1)], advance=False)
    whole.update(["p", "q", "p"], [t(1, 1), t(0), t(0, 1)])
    assert split.state_dict() == whole.state_dict() and split.step == 2


def test_history_on_anchor_base_in_pm1_units():
    base = AnchorPrior({"a": 0.6}, reward_range=(-1.0, 1.0))  # 0.6 -> 0.8 normalised
    prior = HistoryPrior(base=base, strength=5.0, gamma=1.0, reward_range=(-1.0, 1.0))
    assert prior.predict(["a"]).item() == pytest.approx(0.6)
    prior.update(["a"], [t(-1, -1, -1, -1, -1)])  # Beta(4, 1) + 5 failures -> mean 0.4
    assert prior.predict(["a"]).item() == pytest.approx(2 * 0.4 - 1)
    # unknown prompt: the anchor's global mean as prior mean, no evidence
    assert prior.predict(["new"]).item() == pytest.approx(0.6)


def test_history_forwards_updates_to_its_base_and_checks_inputs():
    base = KNNPrior()
    prior = HistoryPrior(base=base)
    prior.update(["a", "b"], [t(1.0), t(0.0, 1.0)], embeddings=torch.eye(2))
    assert len(base) == 2
    with pytest.raises(ValueError, match="outside the prior's reward range"):
        prior.update(["a"], [t(2.0)], embeddings=torch.eye(2)[:1])
    with pytest.raises(ValueError, match="reward groups"):
        prior.update(["a", "b"], [t(1.0)])
    with pytest.raises(ValueError, match="reward range"):
        HistoryPrior(base=AnchorPrior({"a": 0.0}, (-1.0, 1.0)))


@settings(max_examples=50, deadline=None)
@given(
    st.lists(st.lists(st.sampled_from([0.0, 0.25, 1.0]), min_size=1, max_size=6), max_size=8),
    st.floats(0.05, 0.95),
    st.floats(0.5, 8.0),
)
def test_history_without_forgetting_is_the_closed_form(groups, m0, strength):
    prior = HistoryPrior(AnchorPrior({"p": m0}), strength=strength, gamma=1.0)
    for g in groups:
        prior.update(["p"], [torch.tensor(g)])
    total = sum(len(g) for g in groups)
    succ = sum(sum(g) for g in groups)
    expect = (strength * m0 + succ) / (strength + total)
    assert prior.predict(["p"]).item() == pytest.approx(expect, rel=1e-5)


# --- knn --------------------------------------------------------------------------------


def test_knn_identical_neighbours_with_shrinkage_hand_numbers():
    knn = KNNPrior(top_k=8, shrink=1.0, center=False)
    e = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.5, 0.0], [0.0, 3.0]])  # 3 identical directions
    knn.update(["a", "b", "c", "d"], [t(0.9), t(1, 1, 0.7), t(0.9), t(0.1)], embeddings=e)
    # context mean (0.9 + 0.9 + 0.9 + 0.1) / 4 = 0.7; orthogonal entry (cos 0) is no neighbour
    pred = knn.predict(["held-out"], torch.tensor([[5.0, 0.0]]))
    assert pred.item() == pytest.approx((3 * 0.9 + 0.7) / 4)


def test_knn_without_shrinkage_returns_the_identical_neighbour_value():
    knn = KNNPrior(shrink=0.0, temperature=0.01, center=False)
    e = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    knn.update(["a", "b", "c"], [t(0.2), t(0.5), t(1.0)], embeddings=e)
    pred = knn.predict(["x", "y"], torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 7.0]]))
    assert torch.allclose(pred, t(0.5, 1.0), atol=1e-6)


def test_knn_falls_back_to_context_mean_and_default():
    knn = KNNPrior(reward_range=(-1.0, 1.0), center=False)
    assert knn.predict(["x"], torch.ones(1, 2)).item() == 0.0  # empty context: range middle
    knn.update(["a", "b"], [t(1.0), t(-1.0, 0.0)], embeddings=torch.tensor([[1.0, 0], [1.0, 0]]))
    # a query orthogonal to every entry has no neighbours: context mean (1 - 0.5) / 2
    assert knn.predict(["x"], torch.tensor([[0.0, 1.0]])).item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="needs prompt embeddings"):
        knn.predict(["x"])
    with pytest.raises(ValueError, match="embedding size"):
        knn.predict(["x"], torch.ones(1, 3))


def test_knn_centering_removes_a_shared_offset():
    # every embedding = a large common offset + a small prompt-specific direction
    offset = torch.tensor([10.0, 10.0, 0.0])
    e = offset + torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 1.0], [0.0, 0.0, -1.0]])
    rewards = [t(1.0), t(1.0), t(0.0)]
    q = offset + torch.tensor([[0.0, 0.0, -0.5]])  # closest in direction to the third prompt
    plain = KNNPrior(shrink=0.0, temperature=0.1, center=False)
    plain.update(["a", "b", "c"], rewards, e)
    centred = KNNPrior(shrink=0.0, temperature=0.1)
    centred.update(["a", "b", "c"], rewards, e)
    # uncentred, all three look alike (cos > 0.99) and the average wins: about 2/3
    assert plain.predict(["q"], q).item() == pytest.approx(2 / 3, abs=0.05)
    # centred (context mean [10, 10, 1/3]): the query points like the third entry only
    assert centred.predict(["q"], q).item() == pytest.approx(0.0, abs=1e-6)


def test_knn_window_keeps_the_most_recent_entries():
    knn = KNNPrior(window=256)
    for step in range(3):
        ids = [f"{step}-{i}" for i in range(100)]
        values = [torch.tensor([(step * 100 + i) / 300]) for i in range(100)]
        knn.update(ids, values, embeddings=torch.randn(100, 4))
    assert len(knn) == 256 and knn.keys.shape == (256, 4)
    assert knn.values[0].item() == pytest.approx(44 / 300)
    assert knn.values[-1].item() == pytest.approx(299 / 300)


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 20), st.floats(0.01, 2.0), st.floats(0.0, 3.0))
def test_knn_prediction_stays_within_the_context_values(seed, n, temperature, shrink):
    g = torch.Generator().manual_seed(seed)
    knn = KNNPrior(top_k=5, temperature=temperature, shrink=shrink, min_similarity=-1.0)
    values = torch.rand(n, generator=g)
    knn.update([str(i) for i in range(n)], list(values[:, None]), torch.randn(n, 3, generator=g))
    pred = knn.predict(["q"] * 4, torch.randn(4, 3, generator=g))
    assert bool((pred >= values.min() - 1e-6).all() and (pred <= values.max() + 1e-6).all())


# --- metrics ----------------------------------------------------------------------------


def test_auc_hand_cases():
    true = t(0.1, 0.4, 0.6, 0.9)
    assert concordance_auc(t(1, 2, 3, 4), true) == 1.0
    assert concordance_auc(t(4, 3, 2, 1), true) == 0.0
    assert concordance_auc(t(5, 5, 5, 5), true) == 0.5
    # binary truth: ROC AUC; positives 0.35, 0.8 vs negatives 0.1, 0.4 -> 3 of 4 pairs
    assert concordance_auc(t(0.1, 0.4, 0.35, 0.8), t(0, 0, 1, 1)) == 0.75
    assert math.isnan(concordance_auc(t(0.1, 0.2), t(0.5, 0.5)))
    # chunking does not change the answer
    g = torch.Generator().manual_seed(0)
    s, y = torch.rand(300, generator=g), torch.rand(300, generator=g).round(decimals=1)
    assert concordance_auc(s, y, chunk=7) == pytest.approx(concordance_auc(s, y))


def test_ece_and_mse_hand_case():
    pred, true = t(0.05, 0.15, 0.95, 0.95), t(0.0, 0.3, 1.0, 0.8)
    # bins: |0.05 - 0| * 1/4 + |0.15 - 0.3| * 1/4 + |0.95 - 0.9| * 2/4 = 0.075
    assert ece(pred, true) == pytest.approx(0.075)
    assert ece(t(1.0), t(0.0)) == pytest.approx(1.0)  # 1.0 falls in the last bin
    m = prior_metrics(pred, true)
    assert m["mse"] == pytest.approx((0.05**2 + 0.15**2 + 0.05**2 + 0.15**2) / 4)
    assert m["auc"] == pytest.approx(5.5 / 6) and m["n"] == 4  # the 0.95 tie scores 1/2


def test_prior_metrics_normalise_pm1_units_and_rollout_auc():
    m = prior_metrics(t(-0.6, 0.4), t(-1.0, 0.0), [t(-1, 1), t(1, 1)], reward_range=(-1, 1))
    assert m["mse"] == pytest.approx((0.2**2 + 0.2**2) / 2)
    # items (0.2, 0), (0.2, 1), (0.7, 1), (0.7, 1): tie 1/2 + 2 wins over 3 ranked pairs
    assert m["auc_rollout"] == pytest.approx(2.5 / 3)


def test_evaluate_prior_reports_metrics_and_means():
    prior = AnchorPrior({"a": -0.5, "b": 0.5}, reward_range=(-1.0, 1.0))
    out = evaluate_prior(prior, ["a", "b"], t(-0.5, 1.0))
    assert out["auc"] == 1.0
    assert out["mse"] == pytest.approx(0.25**2 / 2)
    assert out["pred_mean"] == pytest.approx(0.5) and out["true_mean"] == pytest.approx(0.625)


# --- embeddings -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def test_prompt_embeddings_mean_pool_the_last_hidden_state(tiny_llama):
    prompts = [[3, 4, 5], [7, 8, 9, 10, 11, 12], [20]]
    tiny_llama.train()
    emb = prompt_embeddings(tiny_llama, None, prompts, batch_size=2)
    assert emb.shape == (3, 16) and emb.dtype == torch.float32
    assert tiny_llama.training  # mode restored
    for i, ids in enumerate(prompts):  # padding in a batch does not change any embedding
        with torch.no_grad():
            tiny_llama.eval()
            h = tiny_llama(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]
        assert torch.allclose(emb[i], h[0].mean(0), atol=1e-5)


def test_prompt_embeddings_encode_strings_with_the_tokenizer(tiny_llama):
    class CharTokenizer:
        def __call__(self, text: str) -> dict[str, list[int]]:
            return {"input_ids": [1 + (ord(c) % 30) for c in text]}

    tok = CharTokenizer()
    emb = prompt_embeddings(tiny_llama, tok, ["abc", "hello"])
    ids = prompt_embeddings(tiny_llama, None, [tok("abc")["input_ids"], tok("hello")["input_ids"]])
    assert torch.equal(emb, ids)
    with pytest.raises(ValueError, match="no tokens"):
        prompt_embeddings(tiny_llama, tok, ["abc", ""])
    with pytest.raises(ValueError, match="need a tokenizer"):
        prompt_embeddings(tiny_llama, None, ["abc"])
