"""Asynchronous rollouts (cluster.async_steps=1 and 2) on a local 2-CPU Ray: a prefetched
rollout is sampled with the weights before the next sync, the ratio divides by the log-probs
of the weights that sampled the tokens, the prefetch queue, truncated importance weights,
and the refused settings."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
from helpers import metrics_but_timings

from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster.asynchronous import PrefetchingEngine, _key, truncated_is_weights
from anchor_rl.cluster.engine import RayEngine
from anchor_rl.models.factory import build_model
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.rollout.engine import HFEngine, group_requests
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12)


def _requests(stream: str):
    return group_requests(["1+1=", "what is 12*3?", "x"], [0, 1, 2], 2, 0, stream)


def _same(a, b) -> None:
    assert a.texts == b.texts and torch.equal(a.response_ids, b.response_ids)
    torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-5)


def test_a_prefetched_rollout_uses_the_weights_before_the_next_sync(
    ray_local, tokenizer, one_thread
) -> None:
    old = build_model("tiny", tokenizer, seed=0)
    new = build_model("tiny", tokenizer, seed=1)
    engine = PrefetchingEngine(RayEngine(old, tokenizer, workers=1, threads_per_worker=1))
    try:
        engine.prefetch(_requests("a"), PARAMS)
        engine.sync_weights(new.state_dict())  # sent after the prefetch: runs after it
        prefetched = engine.rollout(_requests("a"), PARAMS)
        assert engine.take_staleness() == 1 and engine.take_staleness() == 0
        _same(prefetched, HFEngine(old, tokenizer).rollout(_requests("a"), PARAMS))
        fresh = engine.rollout(_requests("a"), PARAMS)  # not prefetched: sampled now
        _same(fresh, HFEngine(new, tokenizer).rollout(_requests("a"), PARAMS))
        assert fresh.texts != prefetched.texts
        engine.prefetch(_requests("b"), PARAMS)
        engine.rollout(_requests("c"), PARAMS)  # another call: the prefetch stays pending
        engine.discard()
        assert (engine.prefetched, engine.discarded, engine.take_staleness()) == (1, 1, 0)
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ahead", "steps", "staleness"), [(1, 3, [0.0, 1.0, 1.0]), (2, 4, [0.0, 1.0, 2.0, 2.0])]
)
def test_an_asynchronous_run_divides_by_the_weights_that_sampled(
    ray_local, parity, tiny, tmp_path, one_thread, ahead, steps, staleness
) -> None:
    overrides = [*tiny, f"steps={steps}", "optim.lr=1e-2", "cluster.rollout_workers=1",
                 f"cluster.async_steps={ahead}", "rollout.engine_args.threads_per_worker=1"]  # fmt: skip
    run = start_run(load_config("grpo", overrides), tmp_path / "async")
    initial = {k: v.clone() for k, v in run.policy.state_dict().items()}
    batches = []
    inner = run.engine.rollout

    def record(*args, **kwargs):
        batches.append(inner(*args, **kwargs))
        return batches[-1]

    run.engine.rollout = record
    engine = run.engine
    try:
        train(run)
        rows = [r for r in read_metrics(run.run_dir) if "async/staleness" in r]
        assert [r["async/staleness"] for r in rows] == staleness
        assert (engine.prefetched, engine.discarded) == (steps - 1, 0)  # none past the last step
        # step 1 divides by the weights it updates (ratio 1); later steps by earlier ones
        assert rows[0]["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
        assert all(abs(r["policy/ratio_mean"] - 1.0) > 1e-4 for r in rows[1:])
        # the rollouts of steps 2..1+ahead were all sent before the first update: they are
        # the initial weights' samples
        model = build_model("tiny", run.tokenizer, seed=0)
        model.load_state_dict(initial)
        for batch in batches[1 : 1 + ahead]:
            with torch.no_grad():
                logp, _ = token_logprobs(model.eval(), batch)
            torch.testing.assert_close(batch.logprobs, logp, rtol=0, atol=1e-5)
    finally:
        engine.close()


@pytest.mark.slow
def test_an_asynchronous_run_resumes_with_the_rollouts_it_had_prefetched(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    """k = 2: the checkpoint after step 1 holds the rollouts already sampled for steps 2 and
    3, so the run resumed from it logs the metrics and ends with the weights of the run that
    went on (without them step 2 would be sampled afresh, with staleness 0)."""
    overrides = [*tiny, "steps=3", "optim.lr=1e-2", "eval.every=0", "cluster.rollout_workers=1",
                 "cluster.async_steps=2", "rollout.engine_args.threads_per_worker=1",
                 "checkpoint.every=1", "checkpoint.keep=3"]  # fmt: skip
    whole = start_run(load_config("grpo", overrides), tmp_path / "whole")
    try:
        train(whole)
    finally:
        whole.engine.close()
    saved = torch.load(
        tmp_path / "whole/checkpoints/step_000001/async_prefetch.pt", weights_only=True
    )
    # steps 2 and 3, both sent during step 1 before its update's weight sync
    assert [call["age"] for call in saved["pending"]] == [1, 1]
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    resumed = resume_run(tmp_path / "resumed", from_checkpoint="step_000001")
    try:
        train(resumed)
    finally:
        resumed.engine.close()
    a, b = metrics_but_timings(whole.run_dir), metrics_but_timings(resumed.run_dir)
    assert [r["async/staleness"] for r in b if "async/staleness" in r] == [0.0, 1.0, 2.0]
    assert a == b
    for (name, x), y in zip(whole.policy.state_dict().items(),
                            resumed.policy.state_dict().values(), strict=True):  # fmt: skip
        assert torch.equal(x, y), name


class _Submitting:
    """An engine with ``submit`` that records what it was asked for (no sampling)."""

    def __init__(self) -> None:
        self.submitted, self.sampled_now = [], []

    def submit(self, requests, params, tools=None, instruction=None):
        self.submitted.append(requests[0].prompt)
        return SimpleNamespace(result=lambda prompt=requests[0].prompt: f"prefetched {prompt}")

    def rollout(self, requests, params, tools=None, instruction=None):
        self.sampled_now.append(requests[0].prompt)
        return f"now {requests[0].prompt}"

    def sync_weights(self, state) -> None:
        pass


def test_prefetches_queue_in_order_and_the_ones_passed_by_are_discarded() -> None:
    inner = _Submitting()
    engine = PrefetchingEngine(inner)
    a, b, c = (_requests(name) for name in "abc")
    engine.prefetch(a, PARAMS)
    engine.prefetch(b, PARAMS)
    engine.prefetch(a, PARAMS)  # already pending: not sent again
    assert inner.submitted == ["1+1=", "1+1="] and engine.pending == 2
    engine.sync_weights({})
    engine.sync_weights({})
    assert engine.rollout(b, PARAMS) == "prefetched 1+1="  # b, sent 2 syncs ago
    assert (engine.take_staleness(), engine.pending, engine.prefetched) == (2, 1, 1)
    assert engine.rollout(c, PARAMS) == "now 1+1=" and inner.sampled_now == ["1+1="]
    assert engine.take_discarded() == 0
    engine.retain([(c, PARAMS, None, None)])  # the stream moved past a
    assert (engine.pending, engine.discarded) == (0, 1)
    assert engine.take_discarded() == len(a) and engine.take_discarded() == 0  # a cost, once
    engine.prefetch(c, PARAMS)
    engine.discard()
    assert (engine.pending, engine.discarded, engine.take_discarded()) == (0, 2, len(c))


def test_a_run_resumed_with_fewer_async_steps_drops_the_prefetches_that_would_be_too_stale():
    """Two queued batches, each 1 sync old at the checkpoint: under async_steps=2 both are
    collected (staleness 1, then 2); under 1 the second would be 2 syncs stale when collected,
    so it is discarded (counted) and its step samples afresh."""
    batch = RolloutBatch(
        group=torch.tensor([0]), prompt_ids=[[5]], response_ids=torch.tensor([[7]]),
        attention_mask=torch.ones(1, 1), loss_mask=torch.ones(1, 1), logprobs=torch.zeros(1, 1),
        texts=["x"], tool_calls=torch.zeros(1, dtype=torch.long),
        truncated=torch.zeros(1, dtype=torch.bool),
    )  # fmt: skip
    saved = PrefetchingEngine(_Submitting())
    a, b = _requests("a"), _requests("b")
    for requests in (a, b):
        saved._pending.append(
            (_key(requests, PARAMS, None, None), SimpleNamespace(result=lambda: batch), 0, len(a))
        )
    saved.sync_weights({})
    state = saved.state_dict()
    assert [call["age"] for call in state["pending"]] == [1, 1]
    for steps, kept in ((2, 2), (1, 1)):
        engine = PrefetchingEngine(_Submitting())
        engine.load_state_dict(state, max_staleness=steps)
        assert engine.pending == kept and engine.take_discarded() == (2 - kept) * len(a)
        engine.rollout(a, PARAMS)
        assert engine.take_staleness() == 1
    assert engine.rollout(b, PARAMS) == "now 1+1="  # the dropped one: sampled now


def test_truncated_importance_weights_cap_and_mask() -> None:
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2], [0.4, 0.1, 0.3]]))
    behaviour = torch.log(torch.tensor([[0.5, 0.3, 0.4], [0.1, 0.1, 0.6]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    weights, metrics = truncated_is_weights(logp, behaviour, mask, cap=2.0)
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, 0.5], [2.0, 1.0, 0.0]]))
    assert metrics["async/tis_weight_mean"] == pytest.approx(6.5 / 5)
    assert metrics["async/tis_capped_frac"] == pytest.approx(2 / 5)  # 3.0 and 4.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.async_steps=1"], "needs cluster.rollout_workers > 0"),
        (["cluster.async_steps=1", "cluster.rollout_workers=1", "rollout.top_p=0.9"],
         "needs rollout.top_p = 1"),
        (["cluster.async_correction=tis"], "cluster.async_correction has no effect"),
        (["cluster.async_steps=1", "cluster.rollout_workers=1", "cluster.tis_cap=3"],
         "set cluster.async_correction=tis"),
    ],
)  # fmt: skip
def test_refused_asynchronous_settings(overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config("grpo", overrides)


@pytest.mark.slow
def test_truncated_importance_sampling_reweights_stale_steps(
    ray_local, parity, tiny, tmp_path, one_thread
) -> None:
    overrides = [*tiny, "steps=2", "eval.every=0", "optim.lr=1e-2", "cluster.rollout_workers=1",
                 "cluster.async_steps=1", "cluster.async_correction=tis",
                 "rollout.engine_args.threads_per_worker=1"]  # fmt: skip
    run = start_run(load_config("grpo", overrides), tmp_path / "tis")
    try:
        train(run)
    finally:
        run.engine.close()
    first, second = [r for r in read_metrics(run.run_dir) if "async/staleness" in r]
    # step 1 was sampled with the weights it updates: its weights are 1 up to rounding
    assert first["async/tis_weight_mean"] == pytest.approx(1.0, abs=1e-5)
    # the current policy is the denominator (ratio 1); the stale tokens are reweighted
    assert second["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert second["async/tis_weight_mean"] != pytest.approx(1.0, abs=1e-4)
