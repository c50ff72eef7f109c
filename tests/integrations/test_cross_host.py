"""One method, three hosts: PVPO and V0.5 are written once (anchor_rl.methods), so the same
prompts, rewards, stored anchors and seed give the same kept prompts, teacher prompts,
baselines and advantages, bit for bit, through

- the native trainer's components (``anchor-rl train``: trainer.pvpo.PVPO, trainer.v05.V05,
  then the trainer's advantage stage),
- the TRL plug-in's hooks (PVPOGRPOTrainer / V05GRPOTrainer: group sampling at set-up,
  ``_advantages`` on a generation batch),
- the verl trainer (prepare_method at fit start, MethodState.advantage_step on verl's
  DataProto, verl's own compute_advantage with the registered estimators).

Each host keys its anchors its own way (the native trainer and TRL by the presample key of
their reference and sampling settings, verl by the row content), so the same per-prompt
statistics are stored under each host's key; everything after the lookup is shared code.
"""

from __future__ import annotations

import types
from pathlib import Path

import numpy as np
import pytest
import torch
import trl
from helpers import TINY, ParityTask
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.protocol import DataProto

from anchor_rl.anchors.keys import AnchorKey, task_identity
from anchor_rl.anchors.presample import presample_key, task_params
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.integrations.trl import PVPOGRPOTrainer, V05GRPOTrainer
from anchor_rl.integrations.verl.config import MethodConfig
from anchor_rl.integrations.verl.data import dataset_records
from anchor_rl.integrations.verl.trainer import prepare_method
from anchor_rl.models.factory import build_model
from anchor_rl.rollout.spec import load_spec
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.advantage import compute_advantages
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.pvpo import reference_key
from anchor_rl.trainer.run import start_run

M, K = 4, 4
CLASSES = {
    "train-0": [1, 1, 1, 1],  # acc = 1: dropped by group sampling
    "train-1": [1, 1, 1, 1],
    "train-2": [0, 0, 0, 0],  # acc = 0: a teacher trajectory
    "train-3": [0, 0, 0, 0],
    "train-4": [1, 0, 0, 0],
    "train-5": [1, 1, 0, 0],
    "train-6": [1, 1, 1, 0],
    "train-7": [0, 1, 0, 1],
}
"""The reference's presampled rewards per prompt, stored under each host's key."""
STEP = ["train-4", "train-5", "train-2", "train-7"]
"""The prompts of the step every host scores, K responses each."""
REWARDS = torch.tensor(
    [[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 1], [0, 1, 1, 0]], dtype=torch.float32
).flatten()
"""The step's rewards ``[G * K]``, group by group (the teacher row of train-2, its last, is 1)."""


def store_classes(path: Path, key: AnchorKey, ids: list[str]) -> None:
    """CLASSES, in order, under ``key`` for the prompt keys ``ids``."""
    rewards = torch.tensor(list(CLASSES.values()), dtype=torch.float64)
    with AnchorStore(path) as store:
        store.add_rollouts(key, ids, rewards, rewards.bool())


# --- the native trainer ------------------------------------------------------------------


def native_run(preset: str, tmp_path: Path, *extra: str):
    """A run of ``preset`` on the parity task whose store holds CLASSES under its key."""
    db = tmp_path / "native.db"
    overrides = [*TINY, f"pvpo.m={M}", f"rollout.n={K}", f"pvpo.store={db}", "pvpo.prompts=all"]
    cfg = load_config(preset, [*overrides, *extra])
    task = ParityTask()
    reference, tokenizer = load_spec(cfg.model, cfg.task, cfg.task_args, cfg.seed, "cpu", False)
    store_classes(db, reference_key(cfg, task, tokenizer, reference), list(CLASSES))
    return start_run(cfg, tmp_path / f"run-{preset}")


class Scored(types.SimpleNamespace):
    """What the components read of the loop's scored rows: records, ``batch.group[B]``,
    ``rewards[B]``."""

    def __len__(self) -> int:
        return len(self.rewards)


def native_step(records: list[Record], rewards: torch.Tensor) -> types.SimpleNamespace:
    """The loop's view of a step whose prompts are ``records``, K responses each."""
    group = torch.arange(len(records)).repeat_interleave(K)
    scored = Scored(records=records, rewards=rewards, batch=types.SimpleNamespace(group=group))
    return types.SimpleNamespace(scored=scored, metrics={}, timer=None)


def native_advantages(run, component: str, rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages of the step through the component's inputs and the trainer's
    advantage stage (its configured estimator)."""
    records = {r.id: r for r in ParityTask().records("train")}
    step = native_step([records[i] for i in STEP], rewards)
    if component == "v05":
        run.components["v05"].on_rollouts(step)
    inputs = run.components[component].advantage_inputs(step)
    mask = torch.ones(len(rewards), 1)
    inputs |= {"rewards": rewards, "index": step.scored.batch.group, "mask": mask}
    return compute_advantages(run.cfg, inputs)[:, 0]


# --- the TRL plug-in ---------------------------------------------------------------------


def trl_trainer(cls, tmp_path: Path, tokenizer, **sections):
    """A TRL trainer on the parity task whose store holds CLASSES under its key."""
    db = tmp_path / "trl.db"
    task, model = ParityTask(), build_model("tiny", tokenizer, seed=0)
    params = task_params(SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8), task)
    key = presample_key(model, tokenizer, params, task_identity("parity", task, {}), seed=0)
    store_classes(db, key, list(CLASSES))
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=1, num_generations=K,
        per_device_train_batch_size=2 * K, max_completion_length=8, report_to="none",
        save_strategy="no", disable_tqdm=True, bf16=False, seed=0,
    )  # fmt: skip
    pvpo = {"m": M, "store": str(db)} | sections.pop("pvpo", {})
    return cls(
        model=model, args=args, processing_class=tokenizer, task=task, pvpo=pvpo,
        progress=False, **sections,
    )  # fmt: skip


def trl_advantages(trainer, rewards: torch.Tensor) -> torch.Tensor:
    ids = [pid for pid in STEP for _ in range(K)]
    return trainer._advantages(rewards, ids, K)[0]


# --- the verl trainer --------------------------------------------------------------------


def verl_rows() -> list[dict]:
    """The parity prompts as verl dataset rows (the oracle's trace in a field)."""
    task = ParityTask()
    return [
        {
            "raw_prompt": [{"role": "user", "content": r.prompt}],
            "reward_model": {"ground_truth": r.answer},
            "data_source": "parity",
            "extra_info": {"answer": task.trace(r)},
        }
        for r in task.records("train")
    ]


def verl_state(method: str, tmp_path: Path, tokenizer, **node):
    """prepare_method on the rows, CLASSES stored under verl's row keys: ``(prepared, the
    task's prompt id of each row key)``."""
    db = tmp_path / "verl.db"
    records, _ = dataset_records(verl_rows(), "extra_info.answer")
    key = AnchorKey(model="reference", tokenizer="tok", task="parity")
    store_classes(db, key, [r.id for r in records])
    cfg = MethodConfig.model_validate(
        {"method": method, "store": str(db)}
        | {"pvpo": {"anchor_key": key.digest} | node.pop("pvpo", {})}
        | node
    )
    ids = {r.id: f"train-{i}" for i, r in enumerate(records)}
    return prepare_method(cfg, verl_rows(), tokenizer), ids


def verl_advantages(state, rewards: torch.Tensor) -> torch.Tensor:
    """``[B]`` advantages of verl's advantage stage on a DataProto of the step (one response
    token per row, its outcome there)."""
    rows = verl_rows()
    order = [int(pid.split("-")[1]) for pid in STEP for _ in range(K)]
    b = len(order)
    data = DataProto(
        batch=TensorDict(
            {
                "token_level_scores": rewards.unsqueeze(-1).clone(),
                "token_level_rewards": rewards.unsqueeze(-1).clone(),
                "response_mask": torch.ones(b, 1),
            },
            batch_size=[b],
        )
    )

    def column(name: str, values: list) -> None:
        array = np.empty(b, dtype=object)
        array[:] = values
        data.non_tensor_batch[name] = array

    column("uid", [f"uid-{i}" for i in order])
    for name in ("raw_prompt", "reward_model", "data_source"):
        column(name, [rows[i][name] for i in order])
    algo = OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True})
    state.advantage_step(data, algo, K)
    return data.batch["advantages"][:, 0]


# --- the tests ---------------------------------------------------------------------------


@pytest.mark.slow
def test_pvpo_keeps_the_same_prompts_and_gives_the_same_advantages_in_every_host(
    tmp_path, tokenizer, parity, one_thread
) -> None:
    run = native_run("pvpo_paper", tmp_path)  # the hosts build the paper's setting only
    native = run.components["pvpo"]
    trl_pvpo = trl_trainer(PVPOGRPOTrainer, tmp_path, tokenizer)
    prepared, verl_ids = verl_state(
        "pvpo", tmp_path, tokenizer, pvpo={"teacher": "field:extra_info.answer"}
    )

    kept = {
        "native": {r.id for r in native.records},
        "trl": set(trl_pvpo.train_dataset["prompt_id"]),
        "verl": {verl_ids[r.id] for r in prepared.filtered.records},
    }
    assert kept["native"] == kept["trl"] == kept["verl"] == set(CLASSES) - {"train-0", "train-1"}
    taught = {
        "native": set(native.trajectories),
        "trl": set(trl_pvpo.trajectories),
        "verl": {verl_ids[k] for k in prepared.state.trajectories},
    }
    assert taught["native"] == taught["trl"] == taught["verl"] == {"train-2", "train-3"}

    advantages = {
        "native": native_advantages(run, "pvpo", REWARDS),
        "trl": trl_advantages(trl_pvpo, REWARDS),
        "verl": verl_advantages(prepared.state, REWARDS),
    }
    anchors = torch.tensor([sum(CLASSES[p]) / M for p in STEP]).repeat_interleave(K)
    assert torch.equal(advantages["native"], REWARDS - anchors)
    assert torch.equal(advantages["trl"], advantages["native"])
    assert torch.equal(advantages["verl"], advantages["native"])


@pytest.mark.slow
def test_v05_fuses_the_same_baselines_in_every_host(tmp_path, tokenizer, parity, one_thread):
    run = native_run("v05", tmp_path, "rollout.budget=fixed")
    trl_v05 = trl_trainer(V05GRPOTrainer, tmp_path, tokenizer)
    prepared, _ = verl_state("v05", tmp_path, tokenizer, v05={"budget": "fixed"})
    advantages = {
        "native": native_advantages(run, "v05", REWARDS),
        "trl": trl_advantages(trl_v05, REWARDS),
        "verl": verl_advantages(prepared.state, REWARDS),
    }
    assert advantages["native"].abs().sum() > 0
    assert torch.equal(advantages["trl"], advantages["native"])
    assert torch.equal(advantages["verl"], advantages["native"])
