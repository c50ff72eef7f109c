"""benchmarks/probe_layouts.py: its synthetic batches have the profiles' lengths, its cell
counts add up, and every layout is timed on a real model."""

from __future__ import annotations

import probe_layouts as probe
import pytest
import torch

from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.spec import load_spec


@pytest.mark.parametrize("profile", list(probe.PROFILES))
def test_synthetic_batches_follow_their_profile(profile: str) -> None:
    (p_lo, p_hi), (r_lo, r_hi), budget, share_long = probe.PROFILES[profile]
    tokenizer = build_tokenizer()
    assert tokenizer.pad_token_id == 0
    batch = probe.synthetic_batch(profile, tokenizer, vocab=len(tokenizer))
    lengths = batch.attention_mask.sum(-1).long().tolist()
    assert len(batch) == probe.PROMPTS * probe.RESPONSES
    assert all(p_lo <= len(p) <= p_hi and 0 not in p for p in batch.prompt_ids)
    assert len({tuple(p) for p in batch.prompt_ids}) == probe.PROMPTS  # 8 groups of 8
    assert all(r_lo <= n <= r_hi or (share_long and n == budget) for n in lengths)
    assert batch.truncated.tolist() == [n >= budget for n in lengths]
    assert (batch.response_ids[batch.attention_mask == 0] == 0).all()
    assert (batch.response_ids[batch.attention_mask == 1] != 0).all()
    cells = probe.token_cells(batch, micro_batch=16)
    assert cells["shared"] < cells["real"] <= cells["packed"] <= 2 * cells["real"]
    assert cells["real"] <= cells["padded"]
    chosen = probe.gpu_defaults(batch, micro_batch=16, parameters=700_000_000)
    assert sum(chosen.values()) == 4 and "shared" not in chosen


def test_every_layout_is_timed() -> None:
    model, tokenizer = load_spec("random:tiny", "arithmetic", {}, 0, "cpu", progress=False)
    batch = probe.synthetic_batch("short", tokenizer, model.config.vocab_size)
    before = [p.detach().clone() for p in model.parameters()]
    times = probe.layout_times(model.train(), batch, "cpu", False, repeats=1, micro_batch=32)
    for phase in ("update", "reference"):
        assert set(times[phase]) == set(probe.LAYOUTS) and all(t > 0 for t in times[phase].values())
    assert all(p.grad is None for p in model.parameters())  # no gradient left behind
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
