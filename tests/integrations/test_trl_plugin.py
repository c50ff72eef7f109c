"""The TRL plug-in (anchor_rl.integrations.trl) on the CPU with the tiny random model and the
parity task: training steps run, the advantages are anchor_rl.algos' on the same rewards
and anchors (or priors), group sampling filters the dataset, teacher rows enter for the
accuracy-0 prompts with log pi_gt as their old log-probs in every TRL setting, PVPO's
anchors are refreshed every K optimizer steps and a resumed run keeps (and re-finds) them,
errors name the field, and the TRL version pin holds."""

from __future__ import annotations

import copy
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
import torch
import trl
from helpers import ParityTask

import anchor_rl.integrations.trl as plugin
from anchor_rl.algos import advantages as algos
from anchor_rl.algos import v05 as v05_algos
from anchor_rl.anchors.keys import fingerprint_model, task_identity
from anchor_rl.anchors.presample import (
    RolloutSampler,
    presample_key,
    refresh_anchors,
    refresh_key,
    task_params,
)
from anchor_rl.anchors.priors import HistoryPrior
from anchor_rl.anchors.store import AnchorStore, TeacherTrajectory
from anchor_rl.errors import AnchorRLError, ConfigError
from anchor_rl.integrations.trl import (
    SUPPORTED_TRL,
    PVPOGRPOTrainer,
    UnsupportedFeatureError,
    UnsupportedTRLError,
    V05GRPOTrainer,
    check_trl_version,
    task_dataset,
)
from anchor_rl.integrations.trl.base import TEACHER_KEY
from anchor_rl.models.factory import build_model
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record

M, K, MAX_NEW = 4, 4, 8
CLASSES = {
    "train-0": [1, 1, 1, 1],  # acc = 1: dropped by group sampling
    "train-1": [1, 1, 1, 1],
    "train-2": [0, 0, 0, 0],  # acc = 0: the oracle's trace ("0") is their teacher row
    "train-3": [0, 0, 0, 0],
    "train-4": [1, 0, 0, 0],
    "train-5": [1, 1, 0, 0],
    "train-6": [1, 1, 1, 0],
    "train-7": [0, 1, 0, 1],
}
"""The reference's presampled rewards per prompt (stored before the trainer is built)."""
ANCHOR = {pid: sum(r) / len(r) for pid, r in CLASSES.items()}
KEPT = {f"train-{i}" for i in range(2, 8)}
"""The prompts group sampling keeps of CLASSES: the training prompts."""
PARAMS = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW)
"""The sampling settings of grpo_args (those the anchors are sampled with)."""


def grpo_args(tmp_path: Path, **changes: Any) -> trl.GRPOConfig:
    """2 prompts x K completions per step, one optimizer step per generation, fp32 on the CPU."""
    kwargs = dict(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=3, num_generations=K,
        per_device_train_batch_size=2 * K, max_completion_length=MAX_NEW, learning_rate=1e-4,
        report_to="none", logging_steps=1, save_strategy="no", disable_tqdm=True, bf16=False,
        seed=0,
    )  # fmt: skip
    return trl.GRPOConfig(**(kwargs | changes))


def anchor_key(model: Any, tokenizer: Any, task: ParityTask, seed: int = 0):
    """The key `anchor-rl presample --temperature 1 --max-new-tokens 8 --seed SEED` gives this
    model (its weights now) on the task."""
    params = task_params(PARAMS, task)
    return presample_key(model, tokenizer, params, task_identity("parity", task, {}), seed=seed)


def fill_store(path: Path, model: Any, tokenizer: Any, task: ParityTask, seed: int = 0) -> Path:
    """Store CLASSES under the key `anchor-rl presample --temperature 1 --max-new-tokens 8
    --seed SEED` gives this model on the task: the trainer must find them and sample nothing."""
    key = anchor_key(model, tokenizer, task, seed)
    rewards = torch.tensor(list(CLASSES.values()), dtype=torch.float64)
    with AnchorStore(path) as store:
        store.add_rollouts(key, list(CLASSES), rewards, rewards.bool())
    return path


def record(trainer: Any) -> list[tuple[list[dict[str, Any]], dict[str, Any], Any]]:
    """Every training generation batch: (inputs, the trainer's output, the prior before it)."""
    seen: list[tuple[list[dict[str, Any]], dict[str, Any], Any]] = []
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        prior = copy.deepcopy(getattr(trainer, "prior", None))
        output = original(inputs)
        seen.append((inputs, output, prior))
        return output

    trainer._generate_and_score_completions = wrapped
    return seen


def record_steps(trainer: Any) -> list[tuple[int, str]]:
    """Every training generation batch: (``state.global_step`` when it is made, the policy's
    weight fingerprint then)."""
    seen: list[tuple[int, str]] = []
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        policy = trainer.accelerator.unwrap_model(trainer.model)
        seen.append((trainer.state.global_step, fingerprint_model(policy)))
        return original(inputs)

    trainer._generate_and_score_completions = wrapped
    return seen


def logged(trainer: Any, key: str, after: int = 0) -> list[float]:
    """The values of metric ``key`` in the trainer's log history after step ``after`` (a resumed
    run's history holds its checkpoint's), in order."""
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > after]


def check_advantages(batch: tuple, anchors: dict[str, float], task, tokenizer) -> list[str]:
    """Assert a generation batch's advantages are r - anchor (r recomputed from its tokens);
    its prompt ids."""
    inputs, output, _ = batch
    ids = [row["prompt_id"] for row in inputs]
    rewards = task_rewards(output, ids, task, tokenizer)
    expected = algos.pvpo(rewards, torch.tensor([anchors[i] for i in ids]))
    torch.testing.assert_close(output["advantages"], expected)
    return ids


def means(stats: dict[str, Any]) -> dict[str, float]:
    return {pid: stat.mean for pid, stat in stats.items()}


def completion_tokens(output: dict[str, Any], row: int) -> list[int]:
    mask = output["completion_mask"][row].bool()
    return output["completion_ids"][row][mask].tolist()


def task_rewards(
    output: dict[str, Any], ids: list[str], task: ParityTask, tokenizer
) -> torch.Tensor:
    """The task's reward of each completion, recomputed from its tokens: [N]."""
    texts = [
        tokenizer.decode(completion_tokens(output, row), skip_special_tokens=True)
        for row in range(len(ids))
    ]
    records = {r.id: r for r in task.records("train")}
    return torch.tensor([task.reward(t, records[i]) for t, i in zip(texts, ids, strict=True)])


@pytest.fixture
def task() -> ParityTask:
    return ParityTask()


@pytest.fixture
def model(tokenizer):
    return build_model("tiny", tokenizer, seed=0)


def test_pvpo_trains_with_anchor_advantages_group_sampling_and_teacher_rows(
    tmp_path, tokenizer, task, model, one_thread
) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path), processing_class=tokenizer, task=task,
        pvpo={"m": M, "store": str(store)}, progress=False,
    )  # fmt: skip
    # Group sampling, before training: acc = 1 prompts dropped, acc = 0 ones with a trajectory.
    assert {r.id for r in trainer.filter_result.dropped_solved} == {"train-0", "train-1"}
    assert set(trainer.train_dataset["prompt_id"]) == {f"train-{i}" for i in range(2, 8)}
    assert set(trainer.trajectories) == {"train-2", "train-3"}
    counts = trainer.rollout_counts()
    assert counts["presample_now"] == 0 and counts["presample"] == len(CLASSES) * M
    assert counts["teacher"] == 2  # the oracle reads one trace per accuracy-0 prompt

    batches = record(trainer)
    trainer.train()
    assert trainer.state.global_step == 3 and len(batches) == 3
    teacher_rows = set()
    for inputs, output, _ in batches:
        ids = [row["prompt_id"] for row in inputs]
        assert not {"train-0", "train-1"} & set(ids)
        rewards = task_rewards(output, ids, task, tokenizer)
        expected = algos.pvpo(rewards, torch.tensor([ANCHOR[i] for i in ids]))
        torch.testing.assert_close(output["advantages"], expected)
        for last in range(K - 1, len(ids), K):  # the last row of each group
            if ids[last] in trainer.trajectories:
                trace = trainer.trajectories[ids[last]].token_ids.tolist()
                assert completion_tokens(output, last) == trace
                assert rewards[last] == 1.0  # scored by the task like any completion
                teacher_rows.add(ids[last])
                for row in range(last - K + 1, last):  # the group's other rows: the policy's
                    assert completion_tokens(output, row) != trace
    assert teacher_rows == {"train-2", "train-3"}  # one epoch of the 6 kept prompts
    # What TRL logs is the method's advantage: the completions table and the step's mean.
    last_output = batches[-1][1]
    assert list(trainer._logs["advantages"]) == last_output["advantages"].tolist()
    logged = [h for h in trainer.state.log_history if "advantages/mean" in h]
    assert logged[-1]["advantages/mean"] == pytest.approx(last_output["advantages"].mean().item())
    assert sum(h["pvpo/teacher_rows"] for h in logged) == 2
    assert trainer.rollout_counts()["policy"] == 3 * 2 * K


def test_pvpo_presamples_a_prompt_on_its_first_use(
    tmp_path, tokenizer, task, model, one_thread
) -> None:
    params = task_params(SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW), task)
    key = presample_key(model, tokenizer, params, task_identity("parity", task, {}))
    store = tmp_path / "anchors.db"
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, max_steps=2), processing_class=tokenizer,
        task=task, pvpo={"m": M, "store": str(store)}, group_sampling=False, progress=False,
    )  # fmt: skip
    assert trainer.rollout_counts()["presample"] == 0
    batches = record(trainer)
    trainer.train()
    seen = {row["prompt_id"] for inputs, _, _ in batches for row in inputs}
    assert len(seen) == 4
    with AnchorStore(store) as s:
        stored = s.get_anchors(key)  # under the initial policy's key, not the trained one's
    assert set(stored) == seen and all(stat.n == M for stat in stored.values())
    counts = trainer.rollout_counts()
    assert counts["presample_now"] == counts["presample"] == len(seen) * M
    for inputs, output, _ in batches:
        ids = [row["prompt_id"] for row in inputs]
        anchor = torch.tensor([stored[i].mean for i in ids])
        rewards = task_rewards(output, ids, task, tokenizer)
        torch.testing.assert_close(output["advantages"], algos.pvpo(rewards, anchor))


def test_pvpo_refreshes_the_anchors_every_k_optimizer_steps(
    tmp_path, tokenizer, task, model, one_thread
) -> None:
    base = anchor_key(model, tokenizer, task)
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, max_steps=5), processing_class=tokenizer,
        task=task, pvpo={"m": M, "store": str(store), "refresh_every": 2}, progress=False,
    )  # fmt: skip
    batches, steps = record(trainer), record_steps(trainer)
    trainer.train()
    assert [step for step, _ in steps] == [0, 1, 2, 3, 4]  # one generation batch per step
    with AnchorStore(store) as s:
        refreshed = {k: s.get_anchors(refresh_key(base, "reference", k)) for k in (2, 4)}
    for stats in refreshed.values():  # the training prompts, M rollouts each
        assert set(stats) == KEPT and all(stat.n == M for stat in stats.values())
    # The reference refresh sampled the initial weights (kept aside), not the trained policy.
    initial = build_model("tiny", tokenizer, seed=0)
    sampler = RolloutSampler(make_engine("hf", initial, tokenizer), task, PARAMS)
    with AnchorStore(tmp_path / "alone.db") as alone:
        records = [r for r in task.records("train") if r.id in KEPT]
        again = refresh_anchors(records, sampler, alone, base, "reference", 2, M)
    assert means(again.anchors) == means(refreshed[2])
    # Batches made before step 2 use the presampled anchors; from step 2, step 2's; from 4, 4's.
    moved = False
    for batch, (step, _) in zip(batches, steps, strict=True):
        anchors = ANCHOR if step < 2 else means(refreshed[2 if step < 4 else 4])
        ids = check_advantages(batch, anchors, task, tokenizer)
        moved |= any(anchors[i] != ANCHOR[i] for i in ids)
    assert moved  # the refreshed anchors differ from the presampled ones where they were used
    assert trainer.anchor_key == refresh_key(base, "reference", 4)
    counts = trainer.rollout_counts()
    assert counts["presample"] == len(CLASSES) * M and counts["presample_now"] == 0
    assert counts["refresh"] == counts["refresh_now"] == 2 * len(KEPT) * M
    assert counts["total"] == counts["policy"] + counts["presample"] + counts["refresh"] + 2
    assert logged(trainer, "pvpo/refresh_sampled") == [len(KEPT) * M] * 2
    assert len(logged(trainer, "pvpo/refresh_seconds")) == 2


REFRESH_TIMING = {
    # one generation batch trains 3 optimizer steps: steps 2 and 4 pass inside batches, which
    # keep their anchors; the refreshes come with the next batches, at steps 3 and 6, keyed
    # by the steps they were due at, 2 and 6 (a resumed run's batches may start elsewhere)
    "reused": ({"num_iterations": 3, "max_steps": 7}, [0, 3, 6], [2, 6]),
    # one optimizer step spans 2 generation batches: step 2's refresh comes with its first, once
    "accumulated": (
        {
            "per_device_train_batch_size": K,
            "gradient_accumulation_steps": 2,
            "steps_per_generation": 1,
            "max_steps": 3,
        },
        [0, 0, 1, 1, 2, 2],
        [2],
    ),
}
"""setting -> (GRPOConfig changes, global_step of each generation batch, the steps that key
the refreshes) with pvpo.refresh_every = 2."""


@pytest.mark.parametrize("setting", list(REFRESH_TIMING))
def test_pvpo_refresh_comes_with_the_first_generation_batch_after_k_steps(
    setting, tmp_path, tokenizer, task, model, one_thread
) -> None:
    changes, generated, refreshes = REFRESH_TIMING[setting]
    base = anchor_key(model, tokenizer, task)
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, **changes), processing_class=tokenizer, task=task,
        pvpo={"m": M, "store": str(store), "refresh_every": 2}, progress=False,
    )  # fmt: skip
    batches, steps = record(trainer), record_steps(trainer)
    trainer.train()
    assert [step for step, _ in steps] == generated
    with AnchorStore(store) as s:
        stored = {k: means(s.get_anchors(refresh_key(base, "reference", k))) for k in range(8)}
    assert [k for k, rows in stored.items() if rows] == refreshes
    assert len(logged(trainer, "pvpo/refresh_sampled")) == len(refreshes)
    for batch, (step, _) in zip(batches, steps, strict=True):
        last = max((k for k in refreshes if k <= step), default=None)
        check_advantages(batch, ANCHOR if last is None else stored[last], task, tokenizer)


def test_pvpo_policy_refresh_is_keyed_by_the_snapshot_and_a_resume_reuses_it(
    tmp_path, tokenizer, task, model, one_thread
) -> None:
    base = anchor_key(model, tokenizer, task)
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    pvpo = {"m": M, "store": str(store), "refresh_every": 2, "refresh_mode": "policy"}
    common = {"processing_class": tokenizer, "task": task, "pvpo": pvpo, "progress": False}
    args = grpo_args(tmp_path, max_steps=4, save_strategy="steps", save_steps=1)
    trainer = PVPOGRPOTrainer(model=model, args=args, **common)
    batches, steps = record(trainer), record_steps(trainer)
    trainer.train()
    assert [step for step, _ in steps] == [0, 1, 2, 3]
    snapshot = steps[2][1]  # the policy's weights when the refresh at step 2 was made
    assert snapshot not in (base.model, steps[1][1])  # the policy moved
    key = refresh_key(base, "policy", 2, snapshot)
    assert trainer.anchor_key == key and trainer.last_refresh["fingerprint"] == snapshot
    with AnchorStore(store) as s:
        refreshed = s.get_anchors(key)
    assert set(refreshed) == KEPT and all(stat.n == M for stat in refreshed.values())
    for batch, (step, _) in zip(batches, steps, strict=True):
        check_advantages(batch, ANCHOR if step < 2 else means(refreshed), task, tokenizer)
    counts = trainer.rollout_counts()
    assert counts["refresh"] == counts["refresh_now"] == len(KEPT) * M

    def resume(checkpoint: str, out: str):
        fresh = PVPOGRPOTrainer(
            model=build_model("tiny", tokenizer, seed=0),
            args=grpo_args(tmp_path / out, max_steps=4), **common,
        )  # fmt: skip
        seen, at = record(fresh), record_steps(fresh)
        fresh.train(resume_from_checkpoint=str(tmp_path / "out" / checkpoint))
        return fresh, seen, at

    # checkpoint-2 was saved before the refresh at step 2: the resumed run repeats it on the
    # same weights, finds its rows in the store and samples nothing
    again, seen, at = resume("checkpoint-2", "b")
    assert at == steps[2:]  # the same steps, from the same weights
    assert again.anchor_key == key
    assert logged(again, "pvpo/refresh_sampled", after=2) == [0.0]
    assert again.rollout_counts()["refresh_now"] == 0
    assert again.rollout_counts() == trainer.rollout_counts() | {"refresh_now": 0}
    for batch in seen:
        check_advantages(batch, means(refreshed), task, tokenizer)
    # checkpoint-3 was saved after it: the resumed run continues with the refreshed anchors
    later, seen, at = resume("checkpoint-3", "c")
    assert [step for step, _ in at] == [3]
    assert later.anchor_key == key and later.last_refresh == trainer.last_refresh
    assert means(later.anchors) == means(refreshed)
    assert logged(later, "pvpo/refresh_sampled", after=3) == []
    assert len(logged(later, "pvpo/anchor_mean", after=3)) == 1  # it did log its step
    assert later.rollout_counts() == trainer.rollout_counts()
    check_advantages(seen[0], means(refreshed), task, tokenizer)


def test_pvpo_refresh_with_first_use_presampling_covers_the_prompts_used_so_far(
    tmp_path, tokenizer, task, model, one_thread
) -> None:
    base = anchor_key(model, tokenizer, task)
    store = tmp_path / "anchors.db"
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, max_steps=3), processing_class=tokenizer,
        task=task, pvpo={"m": M, "store": str(store), "refresh_every": 1}, group_sampling=False,
        progress=False,
    )  # fmt: skip
    batches = record(trainer)
    trainer.train()
    used = [list(dict.fromkeys(row["prompt_id"] for row in inputs)) for inputs, _, _ in batches]
    assert [len(ids) for ids in used] == [2, 2, 2] and len({*sum(used, [])}) == 6
    with AnchorStore(store) as s:
        keys = [base, refresh_key(base, "reference", 1), refresh_key(base, "reference", 2)]
        stored = [s.get_anchors(key) for key in keys]
    # step 0 presamples its prompts; the refresh at step 1 covers them, and step 1's new
    # prompts are presampled under its key; likewise at step 2
    assert set(stored[0]) == set(used[0])
    assert set(stored[1]) == {*used[0], *used[1]}
    assert set(stored[2]) == {*used[0], *used[1], *used[2]}
    for batch, stats in zip(batches, stored, strict=True):
        check_advantages(batch, means(stats), task, tokenizer)
    counts = trainer.rollout_counts()
    assert counts["presample"] == counts["presample_now"] == 2 * M
    assert counts["refresh"] == counts["refresh_now"] == (4 + 6) * M
    assert logged(trainer, "pvpo/refresh_sampled") == [2 * M, 4 * M]
    assert logged(trainer, "pvpo/presampled_now") == [2 * M] * 3


class _Recording(dict):
    """A loss batch that records what TRL's ``_compute_loss`` reads from it."""

    def __init__(self, batch: dict[str, Any], log: list[tuple[str, Any, Any]]) -> None:
        super().__init__(batch)
        self.log = log

    def get(self, key, default=None):
        value = super().get(key, default)
        if key == "old_per_token_logps":
            self.log.append(("old", self, value))
        return value

    def __getitem__(self, key):
        value = super().__getitem__(key)
        if key == "importance_sampling_ratio":
            self.log.append(("ratio", self, value))
        return value


class _FakeVLLM:
    """vLLM's generation interface: two tokens per prompt with their 'sampling' log-probs."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def sync_weights(self) -> None:
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        completions = [list(self.tokens) for _ in prompts]
        return prompts, completions, [[[-2.0]] * len(self.tokens) for _ in prompts], None


SETTINGS = {
    # TRL keeps no old log-probs (it uses the loss pass's own, detached): one loss call
    "no_old_logps": ({}, 1),
    # ... and the same micro-batch is used twice in one optimizer step
    "no_old_logps_reused": (
        {"num_iterations": 2, "gradient_accumulation_steps": 2, "steps_per_generation": 1},
        2,
    ),
    # TRL computes old log-probs (num_iterations = 2, one micro-batch per optimizer step)
    "old_logps": ({"num_iterations": 2, "max_steps": 2}, 2),
    # vLLM with its importance-sampling correction (a fake engine in TRL's vLLM code path)
    "vllm": ({}, 1),
}
"""setting -> (GRPOConfig changes, loss calls on the one generation batch)."""


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_teacher_rows_pi_gt_reaches_the_loss(
    setting, tmp_path, tokenizer, task, model, one_thread
) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    records = [r for r in task.records("train") if r.id in ("train-2", "train-4")]
    trainer = PVPOGRPOTrainer(
        model=model, args=grpo_args(tmp_path, **({"max_steps": 1} | SETTINGS[setting][0])),
        processing_class=tokenizer, task=task, train_dataset=task_dataset(task, tokenizer, records),
        pvpo={"m": M, "store": str(store)}, progress=False,
    )  # fmt: skip
    tokens = tokenizer.encode("0000", add_special_tokens=False)
    behaviour = -0.1 * torch.arange(1, len(tokens) + 1, dtype=torch.float32)
    trainer.trajectories["train-2"] = TeacherTrajectory(
        "train-2", torch.tensor(tokens), behaviour, torch.ones(len(tokens)), "0000", 1.0, "test"
    )
    if setting == "vllm":
        stop = tokenizer.convert_tokens_to_ids("</answer>")
        trainer.use_vllm, trainer._last_loaded_step = True, -1
        trainer.vllm_importance_sampling_correction = True
        trainer.vllm_generation = _FakeVLLM(
            [tokenizer.encode("1", add_special_tokens=False)[0], stop]
        )
    log: list[tuple[str, Any, Any]] = []
    prepare = trainer._prepare_inputs
    trainer._prepare_inputs = lambda batch: _Recording(prepare(batch), log)
    trainer.train()

    olds = [(batch, value) for kind, batch, value in log if kind == "old"]
    assert len(olds) == SETTINGS[setting][1]
    teacher_rows = 0
    for batch, old in olds:
        assert old is not None
        for row in range(len(batch["completion_ids"])):
            if completion_tokens(batch, row) == tokens:
                teacher_rows += 1
                assert torch.equal(old[row, : len(tokens)].cpu(), behaviour)
            else:
                own = old[row][batch["completion_mask"][row].bool()]
                assert bool((own < 0).all())  # the policy's own log-probs
        assert (TEACHER_KEY in batch) == setting.startswith("no_old_logps")
    assert teacher_rows == len(olds)  # one teacher row in each loss call
    if setting == "vllm":  # the correction is for the policy's sampler: 1 on the teacher row
        ((_, batch, ratio),) = [entry for entry in log if entry[0] == "ratio"]
        teacher = [completion_tokens(batch, row) == tokens for row in range(len(ratio))]
        assert all(bool((ratio[row] == 1).all()) for row in range(len(ratio)) if teacher[row])
        assert any(bool((ratio[row] != 1).any()) for row in range(len(ratio)) if not teacher[row])


def test_v05_fuses_each_group_with_its_prior(tmp_path, tokenizer, task, model, one_thread) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    args = grpo_args(tmp_path, save_strategy="steps", save_steps=3)
    trainer = V05GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, task=task,
        pvpo={"m": M, "store": str(store)}, progress=False,
    )  # fmt: skip
    assert trainer.rollout_counts()["presample_now"] == 0  # the anchor prior's anchors: stored
    batches = record(trainer)
    trainer.train()
    assert trainer.state.global_step == 3 and len(batches) == 3
    weights = []
    for inputs, output, prior in batches:
        ids = [row["prompt_id"] for row in inputs]
        prompts = ids[::K]
        rewards = task_rewards(output, ids, task, tokenizer)
        emp_mean = rewards.view(-1, K).double().mean(dim=1)
        k = torch.full((len(prompts),), K)
        baseline, weight, _ = v05_algos.fuse(emp_mean, k, prior.predict(prompts).double(), 0.25)
        expected = algos.v05(rewards, baseline.float().repeat_interleave(K))
        torch.testing.assert_close(output["advantages"], expected)
        weights += weight.tolist()
    assert max(weights) > 0  # the run rejected a prior somewhere: fusion, not the prior alone
    everything = list(CLASSES)
    first = batches[0][2].predict(everything)
    assert not torch.equal(trainer.prior.predict(everything), first)  # the prior learned
    # The prior is in the checkpoint and comes back when a run resumes from it.
    fresh = V05GRPOTrainer(
        model=build_model("tiny", tokenizer, seed=0), args=grpo_args(tmp_path / "b"),
        processing_class=tokenizer, task=task, pvpo={"m": M, "store": str(store)},
        progress=False,
    )  # fmt: skip
    restored = []
    load = fresh._load_plugin_state

    def spy(state):
        load(state)
        restored.append((fresh.prior.predict(everything), fresh.rollout_counts()))

    fresh._load_plugin_state = spy
    fresh.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    ((prior, counts),) = restored
    assert torch.equal(prior, trainer.prior.predict(everything))
    assert counts == trainer.rollout_counts()


CLOCKS = {
    # one generation batch (2 prompts) trains 4 optimizer steps: 2 iterations x 2 slices,
    # as anchor-rl's optim.epochs = 2, optim.mini_batches = 2 (one step of its clock)
    "reused": ({"num_iterations": 2, "steps_per_generation": 2}, 8, 2, 2),
    # one optimizer step spans 2 generation batches (1 prompt each) sampled from the same
    # weights, each used twice: one step of anchor-rl's clock, not two
    "accumulated": (
        {"num_iterations": 2, "gradient_accumulation_steps": 4, "steps_per_generation": 1},
        2,
        4,
        2,
    ),
}
"""setting -> (GRPOConfig changes, optimizer steps, generation batches, steps of the clock)."""


@pytest.mark.parametrize("setting", list(CLOCKS))
def test_v05_history_clock_counts_anchor_rl_steps_not_optimizer_steps_or_batches(
    setting, tmp_path, tokenizer, task, model, one_thread
) -> None:
    changes, optimizer_steps, generations, clock = CLOCKS[setting]
    gamma, strength = 0.5, 2.0
    args = grpo_args(tmp_path, per_device_train_batch_size=K, max_steps=optimizer_steps, **changes)
    trainer = V05GRPOTrainer(
        model=model, args=args, processing_class=tokenizer, task=task, progress=False,
        v05={"prior": "history", "history_gamma": gamma, "history_strength": strength},
    )  # fmt: skip
    versions: list[int] = []  # the optimizer steps taken when each generation batch was sampled
    generate = trainer._generate_and_score_completions

    def spy(inputs):
        versions.append(trainer.state.global_step)
        return generate(inputs)

    trainer._generate_and_score_completions = spy
    batches = record(trainer)
    trainer.train()
    assert trainer.state.global_step == optimizer_steps
    assert len(batches) == len(versions) == generations
    assert trainer.prior.step == clock == len(set(versions))
    # The prior is anchor-rl's after one update per step with all of the step's rollouts: a
    # step's batches share one clock value, and evidence ages by gamma per step.
    expected = HistoryPrior(None, strength, gamma)
    for version in dict.fromkeys(versions):
        prompts: list[str] = []
        groups: list[torch.Tensor] = []
        for (inputs, output, _), seen in zip(batches, versions, strict=True):
            if seen == version:
                ids = [row["prompt_id"] for row in inputs]
                prompts += ids[::K]
                groups += list(task_rewards(output, ids, task, tokenizer).view(-1, K))
        expected.update(prompts, groups)
    assert trainer.prior.state_dict() == expected.state_dict()


def test_settings_that_cannot_work_are_refused_naming_the_field(
    tmp_path, tokenizer, task, model
) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    common = {"processing_class": tokenizer, "task": task, "progress": False}
    pvpo = {"m": M, "store": str(store)}
    args = grpo_args(tmp_path)
    with pytest.raises(ConfigError, match="reward_funcs: .*with_rewards"):
        PVPOGRPOTrainer(model, [lambda **_: [1.0]], args, pvpo=pvpo, **common)
    with pytest.raises(ConfigError, match=r"pvpo\.m: .*greater than 0"):
        PVPOGRPOTrainer(model, args=args, pvpo={"m": 0}, **common)
    with pytest.raises(ConfigError, match=r"pvpo\.refresh_mode has no effect"):
        PVPOGRPOTrainer(model, args=args, pvpo=pvpo | {"refresh_mode": "policy"}, **common)
    with pytest.raises(ConfigError, match=r"refresh_mode='policy' with presample='first_use'"):
        PVPOGRPOTrainer(
            model, args=args, pvpo=pvpo | {"refresh_every": 2, "refresh_mode": "policy"},
            group_sampling=False, **common,
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"pvpo\.teacher_model.*set group_sampling=True"):
        PVPOGRPOTrainer(
            model, args=args, pvpo=pvpo | {"teacher_model": "x"}, group_sampling=False, **common
        )
    # PVPOConfig's own rules, in the plug-in's names (rollout.top_p is GRPOConfig's top_p)
    with pytest.raises(ConfigError, match=r"pvpo\.teacher_model has no effect: it names"):
        PVPOGRPOTrainer(model, args=args, pvpo=pvpo | {"teacher_model": "x"}, **common)
    with pytest.raises(ConfigError, match=r"with top_p < 1 .* or top_p=1$"):
        PVPOGRPOTrainer(
            model, args=grpo_args(tmp_path, top_p=0.9),
            pvpo=pvpo | {"teacher": "oracle:reference"}, **common,
        )  # fmt: skip
    with pytest.raises(ConfigError, match="top_k=50.*set top_k=0"):
        PVPOGRPOTrainer(model, args=grpo_args(tmp_path, top_k=50), pvpo=pvpo, **common)
    with pytest.raises(ConfigError, match="remove_unused_columns=False"):
        PVPOGRPOTrainer(
            model, args=grpo_args(tmp_path, remove_unused_columns=True), pvpo=pvpo, **common
        )
    plain = datasets.Dataset.from_list([{"prompt": "q0", "prompt_id": "train-0"}])
    with pytest.raises(ConfigError, match="row 0 \\(prompt_id 'train-0'\\).*task_dataset"):
        PVPOGRPOTrainer(model, args=args, train_dataset=plain, pvpo=pvpo, **common)
    stranger = datasets.Dataset.from_list([{"prompt": "q0", "prompt_id": "nope"}])
    with pytest.raises(ConfigError, match="prompt_id 'nope' is not a record"):
        PVPOGRPOTrainer(model, args=args, train_dataset=stranger, pvpo=pvpo, **common)
    with pytest.raises(ConfigError, match=r"v05\.probe_every"):
        V05GRPOTrainer(model, args=args, v05={"probe_every": 5}, **common)
    with pytest.raises(ConfigError, match=r"num_generations=4 above v05\.k_max=2"):
        V05GRPOTrainer(model, args=args, v05={"k_max": 2, "prior": "history"}, **common)
    with pytest.raises(ConfigError, match=r"pvpo with v05\.prior='history'"):
        V05GRPOTrainer(model, args=args, v05={"prior": "history"}, pvpo=pvpo, **common)
    tools = ParityTask()
    tools.tools = {"search": object()}
    with pytest.raises(ConfigError, match="uses tools"):
        PVPOGRPOTrainer(model, args=args, **(common | {"task": tools}))


class _IntIds(ParityTask):
    """The parity task with record ids "0".."7" (a dataset may hold them as integers)."""

    def records(self, split):
        return [Record(str(i), f"q{i}", "even") for i in range(8)]


class _LongTrace(ParityTask):
    """The parity task whose oracle trace (correct) is longer than MAX_NEW tokens."""

    def trace(self, record):
        return "0" * 40


def test_evaluation_prompts_and_integer_ids_find_their_records(
    tmp_path, tokenizer, task, model
) -> None:
    common = {"processing_class": tokenizer, "v05": {"prior": "history"}, "progress": False}
    held_out = task_dataset(task, tokenizer, task.records("test"))
    trainer = V05GRPOTrainer(
        model, args=grpo_args(tmp_path), task=task, eval_dataset={"test": held_out}, **common
    )
    reward = trainer.reward_funcs[0]  # what TRL scores evaluation with, too
    assert reward([None] * 2, ["0", "1"], prompt_id=["test-4", "train-1"]) == [1.0, 0.0]
    unknown = held_out.map(lambda row: {"prompt_id": "nope"})
    with pytest.raises(ConfigError, match="eval_dataset row 0: prompt_id 'nope' is not a record"):
        V05GRPOTrainer(model, args=grpo_args(tmp_path), task=task, eval_dataset=unknown, **common)
    other = held_out.map(lambda row: {"prompt_id": "test-5"})
    with pytest.raises(ConfigError, match=r"eval_dataset\['x'\] row 0 \(prompt_id 'test-5'\)"):
        V05GRPOTrainer(
            model, args=grpo_args(tmp_path), task=task, eval_dataset={"x": other}, **common
        )  # fmt: skip
    # integer prompt ids: the trainer reads them as str, and so does the reward
    ints = task_dataset(_IntIds(), tokenizer)
    ints = datasets.Dataset.from_dict({"prompt": ints["prompt"], "prompt_id": list(range(8))})
    trainer = V05GRPOTrainer(
        model, args=grpo_args(tmp_path), task=_IntIds(), train_dataset=ints, **common
    )
    assert trainer.reward_funcs[0]([None], ["0"], prompt_id=[4]) == [1.0]


def test_too_few_prompts_for_a_generation_batch_are_refused(
    tmp_path, tokenizer, task, model
) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    common = {"processing_class": tokenizer, "task": task, "progress": False}
    args = grpo_args(tmp_path, per_device_train_batch_size=8 * K)  # 8 prompts a batch
    with pytest.raises(ConfigError, match="group sampling kept 6 prompt rows, fewer than the 8"):
        PVPOGRPOTrainer(model, args=args, pvpo={"m": M, "store": str(store)}, **common)
    args = grpo_args(tmp_path, per_device_train_batch_size=4 * K, steps_per_generation=3)
    with pytest.raises(ConfigError, match=r"train_dataset has 8 .* 12 .* 48 // num_generations 4"):
        V05GRPOTrainer(model, args=args, v05={"prior": "history"}, **common)


def test_teacher_rows_are_completions_that_end_or_are_cut_at_max_completion_length(
    tmp_path, tokenizer, task, model
) -> None:
    store = str(fill_store(tmp_path / "anchors.db", model, tokenizer, task))
    common = {"processing_class": tokenizer, "progress": False, "pvpo": {"m": M, "store": store}}
    masked = grpo_args(tmp_path, mask_truncated_completions=True)
    # the oracle's trace "0" gets eos (log pi_gt 0): TRL's mask keeps the row
    trainer = PVPOGRPOTrainer(model, args=masked, task=task, **common)
    trace = tokenizer.encode("0", add_special_tokens=False)
    for traj in trainer.trajectories.values():
        assert traj.token_ids.tolist() == [*trace, tokenizer.eos_token_id]
        assert traj.logprobs.tolist() == [0.0] * 2 and traj.loss_mask.tolist() == [1.0] * 2
    # a trace longer than max_completion_length is cut there, its log-probs too: truncated
    # (the store keeps teacher trajectories by task identity, which the trace is not part of)
    store = str(fill_store(tmp_path / "long.db", model, tokenizer, task))
    common["pvpo"] = {"m": M, "store": store}
    long = PVPOGRPOTrainer(model, args=grpo_args(tmp_path), task=_LongTrace(), **common)
    for traj in long.trajectories.values():
        assert len(traj) == len(traj.logprobs) == MAX_NEW and traj.text == "0" * MAX_NEW
    with pytest.raises(ConfigError, match=r"mask 2 teacher .* fill max_completion_length=8 .* 41"):
        PVPOGRPOTrainer(model, args=masked, task=_LongTrace(), **common)
    # a teacher whose log-prob of an appended eos is unknown
    scored = common | {"pvpo": common["pvpo"] | {"teacher": "oracle:reference"}}
    with pytest.raises(ConfigError, match=r"2 come from pvpo\.teacher='oracle:reference'"):
        PVPOGRPOTrainer(model, args=masked, task=task, **scored)
    with pytest.raises(ConfigError, match=r"v05\.reward_range: must be \(lo, hi\) with lo < hi"):
        V05GRPOTrainer(model, args=masked, task=task, v05={"reward_range": [1.0, 0.0]}, **common)


def test_reward_weights_other_than_1_are_refused(tmp_path, tokenizer, task, model) -> None:
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task)
    common = {"processing_class": tokenizer, "task": task, "progress": False}
    with pytest.raises(ConfigError, match=r"reward_weights=\[2\.0\].*with_rewards"):
        PVPOGRPOTrainer(
            model, args=grpo_args(tmp_path, reward_weights=[2.0]),
            pvpo={"m": M, "store": str(store)}, **common,
        )  # fmt: skip
    with pytest.raises(ConfigError, match=r"reward_weights=\[0\.5\].*with_rewards"):
        V05GRPOTrainer(
            model, args=grpo_args(tmp_path, reward_weights=[0.5]), v05={"prior": "history"},
            **common,
        )  # fmt: skip
    trainer = V05GRPOTrainer(
        model, args=grpo_args(tmp_path, reward_weights=[1.0]), v05={"prior": "history"}, **common
    )
    assert trainer.reward_weights.tolist() == [1.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_new_tokens": 2},
        {"min_new_tokens": 6},
        {"no_repeat_ngram_size": 1},
        {"epsilon_cutoff": 0.01},
        {"eta_cutoff": 0.01},
        {"suppress_tokens": [5]},
        {"begin_suppress_tokens": [5]},
        {"renormalize_logits": True},
        {"forced_eos_token_id": 2},
        {"exponential_decay_length_penalty": (2, 1.5)},
        {"top_k": 5},
        {"use_cache": True, "eos_token_id": 2},
    ],
)
def test_generation_kwargs_that_may_change_what_is_sampled_are_refused(
    tmp_path, tokenizer, task, model, kwargs
) -> None:
    args = grpo_args(tmp_path, generation_kwargs=kwargs)
    with pytest.raises(ConfigError, match=r"generation_kwargs \[.*accepts only"):
        V05GRPOTrainer(
            model, args=args, processing_class=tokenizer, task=task, v05={"prior": "history"},
            progress=False,
        )  # fmt: skip


def test_generation_kwargs_that_change_nothing_sampled_are_accepted(
    tmp_path, tokenizer, task, model
) -> None:
    common = {"processing_class": tokenizer, "task": task, "v05": {"prior": "history"}}
    args = grpo_args(tmp_path, generation_kwargs={"use_cache": True})
    trainer = V05GRPOTrainer(model, args=args, progress=False, **common)
    assert trainer.generation_config.use_cache is True
    assert trainer.generation_config.max_new_tokens == trainer.sampling.max_new_tokens == MAX_NEW
    # stop ids: the task's and eos are where the anchors' rollouts stop (the trainer's own
    # eos_token_ids once it is built: eos, then the task's stops); others are not
    stops = sorted(set(trainer.eos_token_ids))
    args = grpo_args(tmp_path, generation_kwargs={"stop_token_ids": stops})
    V05GRPOTrainer(model, args=args, progress=False, **common)
    other = next(i for i in range(len(tokenizer)) if i not in stops)
    args = grpo_args(tmp_path, generation_kwargs={"stop_token_ids": [*stops, other]})
    with pytest.raises(ConfigError, match=rf"stop_token_ids \[{other}\]"):
        V05GRPOTrainer(model, args=args, progress=False, **common)


def test_pvpo_presample_seed_keys_the_anchors_and_pvpo_prompts_is_refused(
    tmp_path, tokenizer, task, model
) -> None:
    # anchors of `anchor-rl train --preset pvpo seed=7` (or `anchor-rl presample --seed 7`)
    store = fill_store(tmp_path / "anchors.db", model, tokenizer, task, seed=7)
    common = {"args": grpo_args(tmp_path), "processing_class": tokenizer, "task": task}
    pvpo = {"m": M, "store": str(store), "presample_seed": 7}
    trainer = PVPOGRPOTrainer(model, pvpo=pvpo, progress=False, **common)
    assert trainer.anchor_set.key.sampling["seed"] == 7
    assert trainer.rollout_counts()["presample_now"] == 0  # found, not sampled again
    assert {pid: stat.mean for pid, stat in trainer.anchors.items()} == ANCHOR
    v05 = V05GRPOTrainer(
        model, v05={"prior": "anchor"}, pvpo=pvpo, progress=False, **common
    )  # fmt: skip
    assert v05.anchor_set.key.sampling["seed"] == 7 and v05.anchor_set.result.rollouts == 0
    # first-use presampling goes under the same seed
    late = PVPOGRPOTrainer(
        model, pvpo=pvpo | {"store": str(tmp_path / "late.db")}, group_sampling=False,
        progress=False, **common,
    )  # fmt: skip
    late._before_batch(["train-0"])
    assert late.anchor_set.key.sampling["seed"] == 7
    with AnchorStore(tmp_path / "late.db") as s:
        assert set(s.get_anchors(late.anchor_set.key)) == {"train-0"}
    with pytest.raises(ConfigError, match=r"pvpo\.prompts=2: .*every prompt"):
        PVPOGRPOTrainer(model, pvpo=pvpo | {"prompts": 2}, progress=False, **common)
    with pytest.raises(ConfigError, match=r"pvpo\.prompts"):
        V05GRPOTrainer(
            model, v05={"prior": "anchor"}, pvpo=pvpo | {"prompts": 2}, progress=False, **common
        )  # fmt: skip


def test_what_the_plugin_cannot_do_raises_not_implemented(tmp_path, tokenizer, task, model) -> None:
    common = {"args": grpo_args(tmp_path), "processing_class": tokenizer, "task": task}
    with pytest.raises(NotImplementedError, match="num_generations per prompt") as err:
        V05GRPOTrainer(model, budget="adaptive", **common)
    assert isinstance(err.value, UnsupportedFeatureError) and isinstance(err.value, AnchorRLError)


def test_the_trl_version_pin() -> None:
    check_trl_version(trl.__version__)  # the installed TRL is a supported one
    for version in ("1.16.0", "1.16.7"):
        check_trl_version(version)
    for version in ("1.15.9", "1.17.0", "2.0.0", "not-a-version"):
        with pytest.raises(UnsupportedTRLError, match=re.escape(SUPPORTED_TRL)) as err:
            check_trl_version(version)
        assert isinstance(err.value, ImportError) and isinstance(err.value, AnchorRLError)


def test_importing_the_plugin_refuses_an_unsupported_trl(monkeypatch) -> None:
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    with pytest.raises(ImportError, match="supports TRL >=1.16.0,<1.17, found 1.17.0"):
        importlib.reload(plugin)
    monkeypatch.undo()
    importlib.reload(plugin)


HOOKS = {
    "_generate": ["self", "prompts"],
    "_generate_and_score_completions": ["self", "inputs"],
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_compute_loss": ["self", "model", "inputs"],
    "_get_per_token_logps_and_entropies": ["self", "model", "input_ids", "attention_mask"],
    "_tokenize_prompts": ["self", "prompts"],
    "_save_checkpoint": ["self", "model", "trial"],
    "_load_optimizer_and_scheduler": ["self", "checkpoint"],
}


def test_the_private_hooks_the_plugin_overrides_exist_in_this_trl() -> None:
    for name, params in HOOKS.items():
        found = list(inspect.signature(getattr(trl.GRPOTrainer, name)).parameters)
        assert found[: len(params)] == params, name
    source = inspect.getsource(trl.GRPOTrainer._compute_loss)
    # the order the no-old-log-probs path relies on: the log-prob pass, then the read
    assert source.index("_get_per_token_logps_and_entropies") < source.index(
        'inputs.get("old_per_token_logps")'
    )


def test_the_integrations_package_does_not_import_trl() -> None:
    code = "import sys, anchor_rl.integrations; assert 'trl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
