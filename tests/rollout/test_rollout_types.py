"""RolloutBatch: validation, select, cat (re-padding) and lengths on hand-made rows."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from anchor_rl.batch import RolloutBatch
from anchor_rl.rollout.types import SamplingParams

PAD = 7


def batch(responses: list[list[int]], policy: list[list[int]], group: list[int]) -> RolloutBatch:
    b, t = len(responses), max(len(r) for r in responses)
    ids = torch.full((b, t), PAD)
    att, loss = torch.zeros(b, t), torch.zeros(b, t)
    for i, (r, p) in enumerate(zip(responses, policy, strict=True)):
        ids[i, : len(r)] = torch.tensor(r)
        att[i, : len(r)] = 1
        loss[i, : len(r)] = torch.tensor(p, dtype=torch.float32)
    return RolloutBatch(
        group=torch.tensor(group),
        prompt_ids=[[1, i] for i in range(b)],
        response_ids=ids,
        attention_mask=att,
        loss_mask=loss,
        logprobs=-0.5 * loss,
        texts=[f"t{i}" for i in range(b)],
        tool_calls=torch.arange(b),
        truncated=torch.tensor([i % 2 == 1 for i in range(b)]),
        pad_id=PAD,
    )


def test_lengths_count_policy_tokens_only():
    rb = batch([[1, 2, 3], [4, 5, 6, 7]], [[1, 0, 1], [1, 1, 1, 1]], [0, 0])
    assert rb.lengths.tolist() == [2, 4]
    assert len(rb) == 2


def test_select_by_index_and_mask_keeps_rows_in_order():
    rb = batch([[1], [2, 3], [4, 5, 6]], [[1], [1, 1], [1, 0, 1]], [0, 1, 1])
    s = rb.select([2, 0])
    assert s.group.tolist() == [1, 0]
    assert s.response_ids.tolist() == [[4, 5, 6], [1, PAD, PAD]]
    assert s.prompt_ids == [[1, 2], [1, 0]] and s.texts == ["t2", "t0"]
    assert s.tool_calls.tolist() == [2, 0]
    m = rb.select(torch.tensor([False, True, True]))
    assert m.texts == ["t1", "t2"] and m.loss_mask.tolist() == [[1, 1, 0], [1, 0, 1]]
    with pytest.raises(ValueError, match="bool mask"):
        rb.select(torch.tensor([True, False]))


def test_trimmed_cuts_the_columns_past_the_longest_response():
    rb = batch([[1], [2, 3], [4, 5, 6, 7]], [[1], [1, 0], [1, 0, 1, 1]], [0, 1, 1])
    assert rb.trimmed() is rb  # nothing to cut
    short = rb.select([1, 0])  # T = 4 kept, the longest response has 2 tokens
    cut = short.trimmed()
    assert cut.response_ids.tolist() == [[2, 3], [1, PAD]]
    assert cut.attention_mask.tolist() == [[1, 1], [1, 0]]
    assert cut.loss_mask.tolist() == [[1, 0], [1, 0]]
    assert cut.logprobs.tolist() == [[-0.5, 0.0], [-0.5, 0.0]]
    assert cut.texts == short.texts and cut.prompt_ids == short.prompt_ids
    empty = rb.select([0])
    empty.attention_mask[:] = 0
    assert empty.trimmed().response_ids.shape == (1, 1)  # at least one column


def test_cat_repads_to_longest_with_pad_id_and_zero_masks():
    a = batch([[1, 2]], [[1, 1]], [0])
    b = batch([[3, 4, 5, 6]], [[1, 0, 0, 1]], [1])
    c = RolloutBatch.cat([a, b])
    assert c.response_ids.tolist() == [[1, 2, PAD, PAD], [3, 4, 5, 6]]
    assert c.attention_mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert c.logprobs.tolist() == [[-0.5, -0.5, 0, 0], [-0.5, 0, 0, -0.5]]
    assert c.group.tolist() == [0, 1] and c.texts == ["t0", "t0"]


def test_to_moves_every_tensor_field_and_keeps_the_rest():
    rb = batch([[1, 2], [3]], [[1, 0], [1]], [0, 1])
    moved = rb.to("meta")  # a device every tensor must reach
    tensors = [f.name for f in fields(rb) if isinstance(getattr(rb, f.name), torch.Tensor)]
    assert len(tensors) == 7
    for name in tensors:
        before, after = getattr(rb, name), getattr(moved, name)
        assert after.device.type == "meta" and after.dtype == before.dtype, name
        assert after.shape == before.shape and before.device.type == "cpu", name
    assert moved.prompt_ids == rb.prompt_ids and moved.texts == rb.texts
    assert moved.pad_id == PAD
    same = rb.to("cpu")  # already there: the same tensors, no copy
    assert all(getattr(same, n) is getattr(rb, n) for n in tensors)


def test_shape_mismatch_is_rejected():
    rb = batch([[1, 2]], [[1, 1]], [0])
    with pytest.raises(ValueError, match="loss_mask"):
        RolloutBatch(**{**rb.__dict__, "loss_mask": torch.ones(1, 3)})
    with pytest.raises(ValueError, match="texts"):
        RolloutBatch(**{**rb.__dict__, "texts": []})


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": -1}, {"top_p": 0.0}, {"top_p": 1.5}, {"max_new_tokens": 0}, {"max_turns": -1}],
)
def test_sampling_params_reject_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
