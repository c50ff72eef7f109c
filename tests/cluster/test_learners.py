"""Data-parallel learners (cluster.learners > 1): the losses of a sharded batch equal the
whole batch's (by hand), a seeded run on 2 learners matches one learner, a dead rank ends
the run clearly."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
import time
import types
from datetime import timedelta

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from anchor_rl.batch import RolloutBatch
from anchor_rl.cluster import learners as learners_module
from anchor_rl.cluster.learners import LearnerGroup
from anchor_rl.errors import AnchorRLError
from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import apply_lora, trainable_parameters
from anchor_rl.models.scoring import ScoringForward, token_logprobs
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.critic import critic_optimizer, new_critic
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run
from anchor_rl.trainer.update import make_optimizer, ppo_update


def assert_adam_close(one: dict, two: dict, lr: float, steps: int = 1) -> None:
    """Two state dicts trained by AdamW from the same weights on gradients that agree within
    rounding (the ranks sum them in another order). Adam's step is lr * m / (sqrt(v) + eps):
    where a gradient is near eps a float difference moves the weight by up to lr, so a few
    weights may differ by that much (seen: 1 of 1M by 6.6% of lr on one CPU, none on
    another); every other weight agrees within 1% of lr. A missing shard or a flipped sign
    moves most weights by much more (a factor on every gradient does not move Adam's step:
    the callers check the losses, the gradient norm and the moments for that)."""
    off = total = 0
    for name, a in one.items():
        diff = (a - two[name]).abs()
        assert float(diff.max()) <= 2 * steps * lr, name  # no step moves a weight by more
        off += int((diff > 1e-2 * lr).sum())
        total += diff.numel()
    assert off <= max(3, total // 100_000), f"{off} of {total} weights off by > 1% of lr"


def _batch() -> RolloutBatch:
    """5 responses of 1-4 tokens: ragged, an odd count (ranks get 3 and 2 rows)."""
    lengths = [4, 1, 3, 2, 4]
    t = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (t - n) for n in lengths])
    ids = (torch.arange(5 * t).reshape(5, t) % 50 + 14) * mask.long()
    return RolloutBatch(
        group=torch.tensor([0, 0, 1, 1, 1]), prompt_ids=[[5, 20, 21]] * 5, response_ids=ids,
        attention_mask=mask, loss_mask=mask, logprobs=torch.zeros(5, t), texts=[""] * 5,
        tool_calls=torch.zeros(5, dtype=torch.long), truncated=torch.zeros(5, dtype=torch.bool),
    )  # fmt: skip


ADV = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.0])


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
@pytest.mark.parametrize(
    ("agg", "by_hand"),
    [
        # token-mean: -(4*1 - 2*1 + 3*0.5 + 2*3 - 4*1) / 14 tokens
        ("token-mean", -(4 - 2 + 1.5 + 6 - 4) / 14),
        # seq-mean-token-mean: each response's advantage, averaged over the 5 responses
        ("seq-mean-token-mean", -(1 - 2 + 0.5 + 3 - 1) / 5),
    ],
)
def test_two_learners_compute_the_whole_batchs_loss_and_step(
    agg, by_hand, sharding, one_thread
) -> None:
    # padded layout: the packed one lays out each rank's shard differently from the whole
    # batch, which changes the rounding of the forward too (tests/models: packed == padded)
    cfg = load_config(
        "grpo", [f"loss.agg={agg}", "kl.coef=0", "optim.lr=1e-3", "optim.padding_free=off"]
    )
    tokenizer = build_tokenizer()
    batch, mask = _batch(), _batch().loss_mask
    adv = ADV[:, None] * mask

    def fresh():
        model = build_model("tiny", tokenizer, seed=0)
        with torch.no_grad():  # ratio 1 at the first step: the old log-probs are the model's
            old, _ = token_logprobs(model, batch, packed=False)
        return model, old

    one, old = fresh()
    opt, sched = make_optimizer(cfg, one.parameters())
    single = ppo_update(one, opt, sched, batch, mask, old, None, adv, ADV > 0, cfg, None,
                        schedule=[torch.arange(5)])  # fmt: skip
    two, old2 = fresh()
    opt2, sched2 = make_optimizer(cfg, two.parameters())
    group = LearnerGroup(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
        update={"learners": 2, "threads_per_learner": 1, "learner_sharding": sharding})}),
        two, opt2, sched2)  # fmt: skip
    try:
        sharded = group.update(batch, mask, old2, None, adv, ADV > 0, [torch.arange(5)])
        if sharding == "fsdp":  # rank 0 trains a half of the weights beside the run's policy
            trained = group.trained[0]
            local = sum(p.to_local().numel() for p in trained.parameters())
            assert local <= sum(p.numel() for p in two.parameters()) / 2 + 1000
            group.consolidate()  # the shards' AdamW moments, in the run's optimiser
            moments = [opt2.state[p]["exp_avg"] for p in two.parameters()]
            assert all(m.shape == p.shape for m, p in zip(moments, two.parameters(), strict=True))
            torch.testing.assert_close(
                moments[0], opt.state[next(one.parameters())]["exp_avg"], rtol=1e-4, atol=1e-9
            )
    finally:
        group.close()
    assert single["loss/policy"] == pytest.approx(by_hand, rel=1e-6)
    assert sharded["loss/policy"] == pytest.approx(by_hand, rel=1e-6)
    assert sharded["policy/ratio_mean"] == pytest.approx(1.0)
    assert sharded["grad_norm"] == pytest.approx(single["grad_norm"], rel=1e-5)
    # Not bit-equal: the ranks sum their gradients in another order (assert_adam_close)
    assert_adam_close(one.state_dict(), two.state_dict(), cfg.optim.lr)


def test_replicas_accumulate_uneven_micro_batches_and_join_a_mini_batch_without_rows(
    one_thread,
) -> None:
    """DDP replicas: micro-batches of one row give the ranks 3 and 2 passes of the first
    mini-batch (all but the last under no_sync), and the second mini-batch's single row
    leaves rank 1 nothing but a zero-weighted pass; packed scoring goes through DDP too.
    The two optimiser steps are one process's, within the rounding the test above allows."""
    cfg = load_config("grpo", ["kl.coef=0", "optim.lr=1e-3", "optim.micro_batch_size=1"])
    tokenizer = build_tokenizer()
    batch, mask = _batch(), _batch().loss_mask
    adv = ADV[:, None] * mask
    schedule = [torch.arange(5), torch.tensor([3])]
    models = [build_model("tiny", tokenizer, seed=0) for _ in range(2)]
    with torch.no_grad():
        old, _ = token_logprobs(models[0], batch)
    opt, sched = make_optimizer(cfg, models[0].parameters())
    single = ppo_update(models[0], opt, sched, batch, mask, old, None, adv, ADV > 0, cfg, None,
                        schedule=schedule)  # fmt: skip
    opt2, sched2 = make_optimizer(cfg, models[1].parameters())
    group = LearnerGroup(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(
        update={"learners": 2, "threads_per_learner": 1})}), models[1], opt2, sched2)  # fmt: skip
    try:
        two = group.update(batch, mask, old, None, adv, ADV > 0, schedule)
        assert isinstance(group.dp.wrap(models[1], ScoringForward), DistributedDataParallel)
    finally:
        group.close()
    # every rank left by itself (0), none was killed after close's join timeout (-9): the
    # ranks' exit used to deadlock in a DDP reducer's process-group destructor
    assert [p.exitcode for p in group.processes] == [0]
    for key in ("loss/policy", "grad_norm"):
        assert two[key] == pytest.approx(single[key], rel=1e-5), key
    assert_adam_close(models[0].state_dict(), models[1].state_dict(), cfg.optim.lr)


@pytest.mark.slow
@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_a_seeded_run_on_two_learners_matches_one(
    sharding, parity, tiny, tmp_path, one_thread
) -> None:
    # padded layout, as in the test above: packing each rank's shard changes the rounding.
    # 3 steps of 2 mini-batches: with fsdp the run's policy is the ranks' gathered shards
    base = [*tiny, "steps=3", "eval.every=0", "optim.lr=1e-2", "optim.mini_batches=2",
            "cluster.threads_per_learner=1", "optim.padding_free=off"]  # fmt: skip
    one = train(start_run(load_config("grpo", base), tmp_path / "one"))
    two = train(start_run(load_config("grpo", [*base, "cluster.learners=2",
                                               f"cluster.learner_sharding={sharding}"]),
                          tmp_path / "two"))  # fmt: skip
    a, b = read_metrics(one.run_dir), read_metrics(two.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b, strict=True):
        assert ra["reward/mean"] == rb["reward/mean"]  # the same rollouts
        for key in ("loss/policy", "loss/kl", "loss/total", "grad_norm", "policy/ratio_mean"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    assert any(r["grad_norm"] > 0 for r in a)
    assert_adam_close(one.policy.state_dict(), two.policy.state_dict(), 1e-2, steps=6)


@pytest.mark.parametrize("sharding", ["replicate", "fsdp"])
def test_a_run_on_two_learners_resumes_on_one(sharding, parity, tiny, tmp_path, one_thread) -> None:
    base = [*tiny, "eval.every=0", "checkpoint.every=1", "cluster.threads_per_learner=1"]
    two = train(start_run(load_config("grpo", [*base, "steps=2", "cluster.learners=2",
                                               f"cluster.learner_sharding={sharding}"]),
                          tmp_path / "run"))  # fmt: skip
    # the checkpoint holds the whole AdamW state of the 2 steps (consolidated from the shards)
    saved = torch.load(list_checkpoints(two.run_dir)[-1] / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == len(list(two.policy.parameters()))
    assert all(float(entry["step"]) == 2 for entry in saved["state"].values())
    resumed = train(resume_run(two.run_dir, {"steps": 3, "cluster.learners": 1,
                                             "cluster.learner_sharding": "replicate"}))  # fmt: skip
    assert resumed.cfg.cluster.learners == 1 and resumed.learners is None  # never started
    assert [r["step"] for r in read_metrics(resumed.run_dir)] == [1, 2, 3]
    # and back onto 2 learners: the ranks load the checkpoint's optimiser state (3 steps)
    again = train(resume_run(two.run_dir, {"steps": 4, "cluster.learners": 2,
                                           "cluster.learner_sharding": sharding}))  # fmt: skip
    assert [r["step"] for r in read_metrics(again.run_dir)] == [1, 2, 3, 4]
    saved = torch.load(list_checkpoints(again.run_dir)[-1] / "optimizer.pt", weights_only=True)
    assert all(float(entry["step"]) == 4 for entry in saved["state"].values())


@pytest.mark.parametrize("lora", [False, True])
def test_an_fsdp_rank_never_holds_the_whole_model(lora, tmp_path, one_thread, monkeypatch) -> None:
    """Rank 1 of 2 FSDP learners builds the policy and the critic on the meta device, shards
    them, and loads rank 0's weights one tensor at a time: the tensors it holds while it starts
    (counted as operations create them, at their current size) never exceed half of the two
    models plus a few of their largest tensors (the one broadcast whole, and temporaries of
    its shard), and once set up it holds about half (a LoRA run: of the frozen base and of the
    adapters alike). A rank that built the whole model holds all of it at its start."""
    import learner_memory

    overrides = ["cluster.learners=2", "cluster.learner_sharding=fsdp", "optim.padding_free=off",
                 "cluster.threads_per_learner=1", *(["lora.rank=4"] if lora else [])]  # fmt: skip
    cfg = load_config("ppo", overrides)
    policy = apply_lora(build_model("tiny", build_tokenizer(), seed=0), cfg.lora, cfg.seed)
    opt, sched = make_optimizer(cfg, trainable_parameters(policy))
    value = new_critic(cfg, policy)  # separate: a copy of the body (LoRA: the base's, shared)
    monkeypatch.setattr(learners_module, "_learner_main", learner_memory.measured_learner)
    monkeypatch.setenv(learner_memory.REPORT, str(tmp_path / "rank1.json"))
    group = LearnerGroup(cfg, policy, opt, sched, (value, critic_optimizer(cfg, value)))
    group.close()
    held = json.loads((tmp_path / "rank1.json").read_text())
    # what the ranks shard: each model's tensors (a LoRA critic's base is sharded on its own)
    tensors = [t for m in (policy, value) for t in {*m.parameters(), *m.buffers()}]
    whole = sum(t.numel() * t.element_size() for t in tensors)
    largest = max(t.numel() * t.element_size() for t in tensors)
    assert largest < whole / 20  # the bound below is well under the whole
    assert held["largest"] <= largest
    assert held["peak"] <= whole / 2 + 3 * largest, held
    assert 0.45 * whole <= held["end"] <= 0.55 * whole, held


@pytest.mark.slow
def test_a_dead_learner_rank_ends_the_update_clearly(one_thread) -> None:
    cfg = load_config("grpo", ["kl.coef=0", "cluster.learners=2", "cluster.threads_per_learner=1"])
    model = build_model("tiny", build_tokenizer(), seed=0)
    opt, sched = make_optimizer(cfg, model.parameters())
    group = LearnerGroup(cfg, model, opt, sched)
    batch = _batch()
    try:
        os.kill(group.processes[0].pid, signal.SIGKILL)
        group.processes[0].join(timeout=30)
        with pytest.raises(AnchorRLError, match=r"anchor-rl-learner-1 \(exit code -9\).*--resume"):
            group.update(batch, batch.loss_mask, torch.zeros(5, 4), None,
                         ADV[:, None] * batch.loss_mask, ADV > 0, [torch.arange(5)])  # fmt: skip
    finally:
        group.close()


def test_a_rank_that_dies_before_joining_ends_the_start_at_once(one_thread, monkeypatch) -> None:
    """Not after the process group's 30-minute timeout: rank 0 waits for each rank's
    signal that it is joining, and a rank that exited first is named with its exit code."""
    import learner_exits

    monkeypatch.setattr(learners_module, "_learner_main", learner_exits.exit_before_joining)
    cfg = load_config("grpo", ["kl.coef=0", "cluster.learners=3", "cluster.threads_per_learner=1"])
    model = build_model("tiny", build_tokenizer(), seed=0)
    opt, sched = make_optimizer(cfg, model.parameters())
    started = time.monotonic()
    with pytest.raises(
        AnchorRLError, match=r"anchor-rl-learner-\d \(exit code 3\).*before joining"
    ):
        LearnerGroup(cfg, model, opt, sched)
    assert time.monotonic() - started < 120
    assert not torch.distributed.is_initialized()


def test_a_rank_that_cannot_build_its_config_ends_the_start_at_once_with_its_error(
    one_thread, monkeypatch
) -> None:
    """A rank builds its config (importing the run's plugins) and its model before it signals
    that it is joining, so an error there ends the start within seconds, naming the rank,
    its exit code and its error. Here the plugin is a module only this process has (in
    sys.modules), so the spawned rank's import of it fails. It used to come after the
    rendezvous: rank 0 got gloo's "Connection closed by peer" from the state's broadcast."""
    import multiprocessing

    plugin = "anchor_rl_plugin_of_this_process_only"
    monkeypatch.setitem(sys.modules, plugin, types.ModuleType(plugin))
    cfg = load_config("grpo", ["kl.coef=0", "cluster.learners=2", "cluster.threads_per_learner=1",
                               f"plugins={plugin}"])  # fmt: skip
    model = build_model("tiny", build_tokenizer(), seed=0)
    opt, sched = make_optimizer(cfg, model.parameters())
    started = time.monotonic()
    with pytest.raises(
        AnchorRLError,
        match=rf"anchor-rl-learner-1 \(exit code 1: ConfigError: .*plugin '{plugin}' cannot be "
        r"imported.*\) stopped before joining",
    ):
        LearnerGroup(cfg, model, opt, sched)
    assert time.monotonic() - started < 60
    assert not torch.distributed.is_initialized()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("anchor-rl")]


def test_a_rank_that_dies_in_the_rendezvous_ends_the_start_after_its_timeout(
    one_thread, monkeypatch
) -> None:
    """Rank 0 enters the rendezvous once every rank has signalled; a rank that dies in it
    ends the start after ``RENDEZVOUS`` (here 3 s), not the collectives' 30-minute timeout,
    with an error naming the rank and its exit code. A later start in the same process then
    works (the failed rendezvous had counted a group, which named the next one's keys)."""
    import learner_exits

    real = learners_module._learner_main
    monkeypatch.setattr(learners_module, "_learner_main", learner_exits.exit_after_joining)
    monkeypatch.setattr(learners_module, "RENDEZVOUS", timedelta(seconds=3))
    cfg = load_config("grpo", ["kl.coef=0", "cluster.learners=2", "cluster.threads_per_learner=1"])
    model = build_model("tiny", build_tokenizer(), seed=0)
    opt, sched = make_optimizer(cfg, model.parameters())
    started = time.monotonic()
    with pytest.raises(
        AnchorRLError,
        match=r"anchor-rl-learner-1 \(exit code 4\) stopped while the learner ranks started",
    ):
        LearnerGroup(cfg, model, opt, sched)
    assert time.monotonic() - started < 60
    assert not torch.distributed.is_initialized()
    monkeypatch.setattr(learners_module, "_learner_main", real)
    group = LearnerGroup(cfg, model, opt, sched)
    try:
        assert torch.distributed.get_world_size() == 2
    finally:
        group.close()
    assert [p.exitcode for p in group.processes] == [0]


@pytest.mark.parametrize("bad", [1, 0])
def test_the_critics_ranks_agree_to_stop_when_one_ranks_loss_is_not_finite(bad) -> None:
    """2 gloo ranks run the learners' critic update; rank ``bad``'s value loss is infinite
    (its gradient finite, so the summed gradients' norm is finite on both ranks). fit_values
    checks its rank's own loss: that rank used to stop alone while the other stepped and went
    on to the next mini-batch's all-reduce, waiting there for the group's timeout. Now both
    raise NonFiniteError at that step and neither steps; the next update, every loss finite,
    steps both ranks to the same weights."""
    import multiprocessing

    import critic_ranks

    context = multiprocessing.get_context("spawn")
    results = context.SimpleQueue()  # written at once: the ranks leave by os._exit
    address = f"tcp://127.0.0.1:{learners_module._free_port()}"
    ranks = [
        context.Process(
            target=critic_ranks.fit_with_an_infinite_loss, args=(rank, 2, address, bad, results)
        )
        for rank in range(2)
    ]
    for process in ranks:
        process.start()
    got = {}
    deadline = time.monotonic() + 180  # each rank's collectives time out after 60 s
    try:
        while len(got) < len(ranks) and time.monotonic() < deadline:
            if not results.empty():
                rank, first, moved, second, digest = results.get()
                got[rank] = (first, moved, second, digest)
            elif any(p.exitcode not in (None, 0) for p in ranks):
                break
            else:
                time.sleep(0.1)
    finally:
        for process in ranks:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    assert len(got) == 2, f"a rank did not finish: {got}, {[p.exitcode for p in ranks]}"
    good = 1 - bad
    stop = f"NonFiniteError: the value update: a NaN or infinite loss or gradient norm on learner rank {bad} (here: loss sum = "  # noqa: E501
    assert got[bad][0].startswith(stop + "inf"), got[bad]  # each names the rank
    assert got[good][0].startswith(stop) and "sum = inf" not in got[good][0], got[good][0]
    assert not got[0][1] and not got[1][1]  # neither rank stepped
    assert got[0][2] == got[1][2] == "stepped"
    assert got[0][3] == got[1][3]  # still in step: the same weights after the next update


def test_what_learners_do_not_support_yet_is_refused() -> None:
    assert load_config("ppo", ["cluster.learners=2"]).cluster.learners == 2  # the critic too
    assert load_config("grpo", ["cluster.learners=2", "device=cuda"]).device == "cuda"  # NCCL
    with pytest.raises(ConfigError, match="the ranks take GPUs 0..N-1"):
        load_config("grpo", ["cluster.learners=2", "device=cuda:1"])
    with pytest.raises(ConfigError, match="runs on cpu .gloo. or cuda .NCCL., not device=mps"):
        load_config("grpo", ["cluster.learners=2", "device=mps"])
    assert not math.isnan(load_config("grpo", ["cluster.learners=2"]).optim.lr)
    fsdp = ["cluster.learners=2", "cluster.learner_sharding=fsdp"]
    assert load_config("ppo", fsdp).cluster.learner_sharding == "fsdp"  # a separate critic
    with pytest.raises(ConfigError, match="shards a separate critic only"):
        load_config("ppo", [*fsdp, "critic.mode=shared"])
    with pytest.raises(ConfigError, match="scores the update padded"):
        load_config("grpo", [*fsdp, "optim.padding_free=on"])
    with pytest.raises(ConfigError, match="learner_sharding has no effect"):
        load_config("grpo", ["cluster.learner_sharding=fsdp"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "sharding"), [("separate", "replicate"), ("shared", "replicate"), ("separate", "fsdp")]
)
def test_a_ppo_run_on_two_learners_updates_the_critic_as_one_does(
    mode, sharding, parity, tiny, tmp_path, one_thread, monkeypatch
) -> None:
    """The critic's update runs data-parallel too: after 2 steps of PPO (two mini-batches a
    step) the critic's weights, its loss and the policy are one process's within rounding
    (sharded: the ranks' gathered shards, in the run's whole critic and policy)."""
    base = [*tiny, "steps=2", "eval.every=0", "optim.lr=1e-2", "critic.lr=1e-2",
            "optim.mini_batches=2", "cluster.threads_per_learner=1", "optim.padding_free=off",
            f"critic.mode={mode}"]  # fmt: skip
    shards = []  # rank 0's shard of the critic, when sharded
    real = learners_module._sharded_critic
    monkeypatch.setattr(
        learners_module, "_sharded_critic", lambda *a: shards.append(real(*a)) or shards[-1]
    )
    one = train(start_run(load_config("ppo", base), tmp_path / "one"))
    two = train(start_run(load_config("ppo", [*base, "cluster.learners=2",
                                              f"cluster.learner_sharding={sharding}"]),
                          tmp_path / "two"))  # fmt: skip
    assert one.components["critic"].learners is None
    assert two.components["critic"].learners is not None  # the update went to the ranks
    a, b = read_metrics(one.run_dir), read_metrics(two.run_dir)
    assert [r["step"] for r in b] == [1, 2]
    for ra, rb in zip(a, b, strict=True):
        assert ra["reward/mean"] == rb["reward/mean"]
        for key in ("critic/loss", "critic/vf_clipfrac", "critic/grad_norm", "loss/policy"):
            assert rb[key] == pytest.approx(ra[key], rel=1e-4, abs=1e-7), key
    assert all(r["critic/grad_norm"] > 0 for r in a)
    critic_one = one.components["critic"].critic.state_dict()
    critic_two = two.components["critic"].critic.state_dict()
    assert len(shards) == (sharding == "fsdp")
    if shards:  # rank 0 trained half of the critic, gathered into the run's whole one
        local = sum(p.to_local().numel() for p in shards[0][0].parameters())
        assert local <= sum(v.numel() for v in critic_two.values()) / 2 + 1000
    assert_adam_close(critic_one, critic_two, 1e-2, steps=4)
    assert_adam_close(one.policy.state_dict(), two.policy.state_dict(), 1e-2, steps=4)
    # the checkpoint's critic optimiser: one learner's AdamW state (consolidated when sharded)
    saved = [
        torch.load(list_checkpoints(r.run_dir)[-1] / "critic.pt", weights_only=True)["optimizer"]
        for r in (one, two)
    ]
    assert len(saved[1]["state"]) == len(saved[0]["state"]) == len(critic_one)
    for a_state, b_state in zip(
        saved[0]["state"].values(), saved[1]["state"].values(), strict=True
    ):
        assert float(a_state["step"]) == float(b_state["step"]) > 0
        # within rounding: the ranks sum their gradients in another order (1e-3 of the
        # largest moment; a wrong factor, e.g. an average instead of a sum, is 50% off)
        scale = a_state["exp_avg"].abs().max().item()
        torch.testing.assert_close(
            a_state["exp_avg"], b_state["exp_avg"], rtol=1e-3, atol=1e-3 * scale
        )


def test_a_diverging_run_on_two_learners_ends_with_the_divergence(
    parity, tiny, tmp_path, one_thread, monkeypatch
) -> None:
    """lr = 1e30 makes the second update's gradients NaN on both ranks: the run ends with the
    loop's NonFiniteError message, and rank 1 leaves by rank 0's stop (exit code 0). It used to
    die of the error, so rank 0's stop message failed with gloo's "Connection closed by peer",
    which replaced the divergence."""
    from anchor_rl.errors import NonFiniteError

    groups = []

    class Recorded(LearnerGroup):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            groups.append(self)

    monkeypatch.setattr("anchor_rl.trainer.run.LearnerGroup", Recorded)
    cfg = load_config("grpo", [*tiny, "steps=4", "eval.every=0", "optim.lr=1e30",
                               "cluster.learners=2", "cluster.threads_per_learner=1"])  # fmt: skip
    with pytest.raises(NonFiniteError, match=r"step \d+: the policy update: .*nan.*optim\.lr"):
        train(start_run(cfg, tmp_path / "run"))
    assert len(groups) == 1
    assert [p.exitcode for p in groups[0].processes] == [0]


def test_close_does_not_raise_over_the_error_that_ended_the_run(monkeypatch, caplog) -> None:
    """A rank gone before rank 0 noticed: the stop message fails, close logs it and the error
    in flight (here a divergence) is the one raised."""
    from anchor_rl.errors import NonFiniteError

    def closed(*args, **kwargs):
        raise RuntimeError("Connection closed by peer")

    monkeypatch.setattr(learners_module.dist, "broadcast_object_list", closed)
    monkeypatch.setattr(learners_module.dist, "is_initialized", lambda: False)
    group = LearnerGroup.__new__(LearnerGroup)  # no ranks started: only close is exercised
    group.processes = []
    with pytest.raises(NonFiniteError, match="diverged"):
        try:
            raise NonFiniteError("diverged")
        finally:
            group.close()
    assert "did not get the stop message (Connection closed by peer)" in caplog.text
