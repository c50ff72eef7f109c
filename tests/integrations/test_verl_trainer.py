"""The ``anchor_rl`` trainer on verl's real code, on the CPU: built from the example Hydra config
(verl's ppo_trainer.yaml plus the method group), its advantage step on a ``DataProto`` built
as verl's advantage stage builds it, and its whole advantage stage through a real
TransferQueue. Expected advantages come from anchor-rl's own functions on the same inputs."""

from __future__ import annotations

import copy
import json
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import compute_gae_advantage_return
from verl.utils.tensordict_utils import list_of_dict_to_tensordict

from anchor_rl.algos.advantages import masked_whiten, pvpo, v05
from anchor_rl.algos.gae import gae, length_adaptive_lambda
from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.integrations.verl.config import MethodConfig
from anchor_rl.integrations.verl.data import ROW_KEY, dataset_records, row_key
from anchor_rl.integrations.verl.method import NLL_WEIGHT, MethodState
from anchor_rl.integrations.verl.trainer import (
    AnchorRLTrainer,
    object_array,
    prepare_method,
)
from anchor_rl.methods.v05 import build_prior, fuse_groups

CONFIG_DIR = Path(__file__).resolve().parents[2] / "examples" / "verl" / "config"
PROMPTS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 * 6?"}],
    [{"role": "user", "content": "Name a prime above 10."}],
]
ANCHOR_REWARDS = [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
GOLD = "x"
"""Every PROMPTS row's reward_model.ground_truth."""
SOURCE = "openai/gsm8k"
"""Every PROMPTS row's data_source (it picks verl's reward function)."""
KEYS = [row_key(p, GOLD, SOURCE) for p in PROMPTS]


def compose_config(method: str, *overrides: str):
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(
            config_name="anchor_rl_qwen2.5_1.5b",
            overrides=[
                f"anchor_rl_method={method}",
                "actor_rollout_ref.model.path=/nonexistent",
                *overrides,
            ],
        )


@pytest.fixture(scope="module")
def anchors(tmp_path_factory) -> tuple[str, str]:
    """(store file, digest) holding the static anchors of PROMPTS."""
    path = tmp_path_factory.mktemp("store") / "anchors.db"
    key = AnchorKey(model="reference", tokenizer="tok", task="test")
    with AnchorStore(path) as store:
        rewards = torch.tensor(ANCHOR_REWARDS)
        store.add_rollouts(key, KEYS, rewards, rewards > 0)
    return str(path), key.digest


def trainer_for(method: str, anchors: tuple[str, str], *overrides: str) -> AnchorRLTrainer:
    store, digest = anchors
    # only knobs the method reads (others are refused): PVPO without group sampling, V0.5's
    # anchor prior from the stored anchors, VAPO no anchors at all
    reads = {
        "pvpo": [
            f"anchor_rl.pvpo.anchor_key={digest}",
            "anchor_rl.pvpo.group_sampling=false",
            "anchor_rl.pvpo.teacher=null",
        ],
        "v05": [f"anchor_rl.pvpo.anchor_key={digest}"],
        "vapo": [],
    }[method]
    cfg = compose_config(method, f"anchor_rl.store={store}", *reads, *overrides)
    trainer = AnchorRLTrainer(cfg)
    rows = [
        {"raw_prompt": p, "reward_model": {"ground_truth": GOLD}, "data_source": SOURCE}
        for p in PROMPTS
    ]
    trainer.state = prepare_method(trainer.method_cfg, rows).state
    return trainer


def trajectories(seed: int, per_prompt=(3, 4, 2), values: bool = False) -> list[tuple[str, dict]]:
    """(key, fields) of each trajectory as verl's agent loop writes it into TransferQueue."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, n in enumerate(per_prompt):
        for s in range(n):
            length = int(torch.randint(1, 8, (1,), generator=g))
            mask = torch.ones(length, dtype=torch.int64)
            if length >= 4:
                mask[1] = 0  # a tool-output token inside the response
            scores = torch.zeros(length)
            scores[-1] = float(torch.randint(0, 2, (1,), generator=g))
            fields = {
                "uid": f"uid{p}",
                "raw_prompt": PROMPTS[p],
                "reward_model": {"ground_truth": GOLD, "style": "rule"},
                "data_source": SOURCE,
                "prompts": torch.arange(3 + p),
                "responses": torch.randint(5, 50, (length,), generator=g),
                "response_mask": mask,
                "rm_scores": scores,
                "extra_fields": {},
            }
            if values:
                fields["values"] = torch.rand(length, generator=g)
            out.append((f"uid{p}_{s}_0", fields))
    return out


PER_PROMPT = ["uid", "raw_prompt", "reward_model", "data_source", "response_mask", "rm_scores"]
"""The fields the per-prompt methods' advantage stage reads."""


def as_dataproto(rows: list[tuple[str, dict]], names: list[str]) -> DataProto:
    """The DataProto of verl's advantage stage: the fields from TransferQueue, padded."""
    td = list_of_dict_to_tensordict([fields for _, fields in rows]).select(*names)
    non_tensor = {
        name: object_array(td.pop(name).tolist())
        for name in ("uid", "raw_prompt", "reward_model", "data_source")
        if name in names
    }
    data = DataProto(batch=td.to_padded_tensor())
    data.non_tensor_batch.update(non_tensor)
    data.batch["token_level_scores"] = data.batch["rm_scores"]
    data.batch["token_level_rewards"] = data.batch["token_level_scores"]
    return data


def padded(rows: list[tuple[str, dict]], name: str) -> torch.Tensor:
    return torch.nested.nested_tensor(
        [f[name] for _, f in rows], layout=torch.jagged
    ).to_padded_tensor(0)


# --- the composed config and the registered trainer ---------------------------------------


def test_every_verl_key_the_example_sets_is_one_of_verls() -> None:
    """A typo in the example would add a key verl never reads; compare with verl's own config."""
    import verl
    import yaml

    verl_configs = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(verl_configs), version_base=None):
        base = OmegaConf.to_container(compose(config_name="ppo_trainer"), resolve=False)

    def leaves(node, prefix=""):
        for k, v in node.items():
            if isinstance(v, dict):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    files = [
        CONFIG_DIR / "anchor_rl_qwen2.5_1.5b.yaml",
        *sorted((CONFIG_DIR / "anchor_rl_method").glob("*.yaml")),
    ]
    for path in files:
        doc = yaml.safe_load(path.read_text())
        for key in leaves(
            {k: v for k, v in doc.items() if k not in ("hydra", "defaults", "anchor_rl")}
        ):
            node = base
            for part in key.split("."):
                assert part in node, f"{path.name}: {key} is not a verl setting"
                node = node[part]


@pytest.mark.parametrize(
    ("method", "estimator", "critic"),
    [("pvpo", "anchor_rl_pvpo", False), ("v05", "anchor_rl_v05", False), ("vapo", "gae", True)],
)
def test_the_method_group_switches_the_registered_trainer(
    method, estimator, critic, anchors
) -> None:
    trainer = trainer_for(method, anchors)
    assert trainer.config.trainer.v1.trainer_mode == "anchor_rl"
    assert trainer.method_cfg.method == method
    assert trainer.config.algorithm.adv_estimator == estimator and trainer.use_critic is critic
    assert trainer.trainer_mode == "sync"  # verl's sync replay buffer and semantics


@pytest.mark.parametrize(
    ("method", "device", "strategy"),
    [("v05", "cpu", "fsdp2"), ("vapo", "cuda", "fsdp"), ("pvpo", "cuda", "fsdp2")],
)
def test_the_whole_loops_launch_settings_compose(method, device, strategy, tmp_path) -> None:
    """The Hydra overrides of a depth-3 launch (verl_main_ppo.py; the GPU script's too) compose
    with the example config: the strategy reaches the actor, the reference and VAPO's
    critic, a logical GPU is declared on the CPU only, V0.5 keeps its KL loss, V0.5 and VAPO
    take the reference's KL in their rewards, with the reference's micro-batch set. The CPU
    refuses FSDP1."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import verl_main_ppo as loop

    settings = loop.overrides(tmp_path, method, 2, device, strategy)
    assert settings[0] == f"anchor_rl_method={method}"
    cfg = compose_config(method, *settings[1:])
    actor_rollout_ref = cfg.actor_rollout_ref
    assert actor_rollout_ref.actor.strategy == strategy == actor_rollout_ref.ref.strategy
    if method == "vapo":
        assert cfg.critic.strategy == strategy == cfg.critic.fsdp.strategy
    assert ("num_gpus" in cfg.ray_kwargs.ray_init) == (device == "cpu")
    assert actor_rollout_ref.actor.use_kl_loss == (method == "v05")
    # V0.5 and VAPO: the reference's KL in the reward (V0.5 in its loss too)
    assert cfg.algorithm.use_kl_in_reward == (method in ("v05", "vapo"))
    if method != "pvpo":
        assert cfg.algorithm.kl_ctrl.kl_coef == loop.KL_IN_REWARD
    if method == "vapo":
        assert cfg.anchor_rl.vapo.lam_alpha == loop.VAPO_LAM_ALPHA
    assert actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == loop.BATCH
    with pytest.raises(ValueError, match="FSDP2 only"):
        loop.overrides(tmp_path, method, 2, "cpu", "fsdp")


@pytest.mark.parametrize(
    "change",
    [
        "actor_rollout_ref.rollout.do_sample=false",
        "actor_rollout_ref.rollout.ignore_eos=true",
        "+data.apply_chat_template_kwargs.enable_thinking=false",
        "actor_rollout_ref.rollout.temperature=0.7",
    ],
)
def test_the_presample_key_changes_with_every_setting_the_reference_samples_under(
    change, tokenizer
) -> None:
    def digest(*overrides: str) -> str:
        cfg = compose_config("pvpo", "anchor_rl.pvpo.reference=ref-A", *overrides)
        fake = types.SimpleNamespace(
            method_cfg=MethodConfig.from_verl(cfg), config=cfg, tokenizer=tokenizer
        )
        return AnchorRLTrainer.presample_key(fake).digest

    assert digest() == digest()
    assert digest(change) != digest()
    cfg = compose_config("pvpo", "anchor_rl.pvpo.reference=ref-A")
    fake = types.SimpleNamespace(
        method_cfg=MethodConfig.from_verl(cfg), config=cfg, tokenizer=tokenizer
    )
    task = json.loads(AnchorRLTrainer.presample_key(fake).task)
    assert task["anchor_ids"] == ROW_KEY  # anchors under another id scheme have another key


# --- the advantage step on a DataProto ------------------------------------------------------


def test_pvpo_advantage_is_reward_minus_the_prompts_anchor(anchors) -> None:
    trainer = trainer_for("pvpo", anchors)
    rows = trajectories(0)
    data = as_dataproto(rows, PER_PROMPT)
    metrics = trainer.state.advantage_step(data, trainer.config.algorithm, 8)
    rewards = padded(rows, "rm_scores").sum(-1)
    mask = padded(rows, "response_mask").float()
    anchor = torch.tensor([sum(ANCHOR_REWARDS[int(f["uid"][-1])]) / 4 for _, f in rows])
    expected = pvpo(rewards, anchor).unsqueeze(-1) * mask
    torch.testing.assert_close(data.batch["advantages"], expected)
    torch.testing.assert_close(data.batch["returns"], expected)
    assert metrics["pvpo/anchor_mean"] == pytest.approx(anchor.mean().item())
    assert "reward_baselines" not in data.batch


def test_v05_advantage_uses_the_fused_baseline_and_the_prior_learns(anchors) -> None:
    trainer = trainer_for("v05", anchors)
    vc = trainer.method_cfg.v05.v05_config()
    keys = KEYS
    means = {k: sum(r) / 4 for k, r in zip(keys, ANCHOR_REWARDS, strict=True)}
    reference = build_prior(vc, means)  # the prior as it stands before the step
    rows = trajectories(1)
    data = as_dataproto(rows, PER_PROMPT)
    metrics = trainer.state.advantage_step(data, trainer.config.algorithm, 4)

    rewards = padded(rows, "rm_scores").sum(-1)
    group = torch.tensor([int(f["uid"][-1]) for _, f in rows])
    fusion = fuse_groups(rewards, group, reference.predict(keys), vc)
    expected = v05(rewards, fusion.baseline.float()[group]).unsqueeze(-1) * padded(
        rows, "response_mask"
    )
    torch.testing.assert_close(data.batch["advantages"], expected)
    assert metrics["v05/baseline_mean"] == pytest.approx(fusion.baseline.mean().item())
    reference.update(keys, [rewards[group == g] for g in range(3)], None)
    torch.testing.assert_close(trainer.state.prior.predict(keys), reference.predict(keys))
    assert not torch.allclose(reference.predict(keys), build_prior(vc, means).predict(keys))


def test_v05_padding_rows_join_no_group_and_teach_the_prior_nothing(anchors) -> None:
    rows = trajectories(2)
    names = PER_PROMPT
    plain_trainer, padded_trainer = trainer_for("v05", anchors), trainer_for("v05", anchors)
    plain = as_dataproto(rows, names)
    plain_trainer.state.advantage_step(plain, plain_trainer.config.algorithm, 4)
    pad = dict(
        rows[0][1],
        uid="padXYZ",
        response_mask=torch.zeros(1, dtype=torch.int64),
        rm_scores=torch.zeros(1),
    )
    with_pad = as_dataproto([*rows, ("padXYZ_0_0", pad)], names)
    valid = torch.tensor([True] * len(rows) + [False])
    padded_trainer.state.advantage_step(with_pad, padded_trainer.config.algorithm, 4, valid)
    width = plain.batch["advantages"].shape[1]
    torch.testing.assert_close(
        with_pad.batch["advantages"][: len(rows), :width], plain.batch["advantages"]
    )
    assert with_pad.batch["advantages"][-1].abs().sum() == 0
    keys = KEYS
    torch.testing.assert_close(
        padded_trainer.state.prior.predict(keys), plain_trainer.state.prior.predict(keys)
    )


def test_vapo_decoupled_length_adaptive_gae_on_the_critics_values(anchors) -> None:
    trainer = trainer_for("vapo", anchors)
    rows = trajectories(3, values=True)
    data = as_dataproto(rows, ["uid", "response_mask", "rm_scores", "values"])
    metrics = trainer.state.advantage_step(data, trainer.config.algorithm, 16)

    mask = padded(rows, "response_mask").float()
    token_rewards, values = padded(rows, "rm_scores"), padded(rows, "values")
    lam = length_adaptive_lambda(mask.sum(-1), 0.05, 0.0)
    expected = masked_whiten(gae(token_rewards, values, mask, 1.0, lam)[0], mask) * mask
    torch.testing.assert_close(data.batch["advantages"], expected)
    # the critic's lambda is 1: Monte-Carlo returns, the outcome on every policy token
    outcome = token_rewards.sum(-1, keepdim=True).expand_as(mask)
    torch.testing.assert_close(data.batch["returns"], torch.where(mask > 0, outcome, 0))
    # verl's own GAE (one lambda for both) gives other advantages
    verl_adv, _ = compute_gae_advantage_return(token_rewards, values, mask, 1.0, 1.0)
    assert not torch.allclose(verl_adv, data.batch["advantages"], atol=1e-3)
    correct = (token_rewards.sum(-1) >= 1.0).float()
    share = (mask.sum(-1) * correct).sum() / mask.sum()
    torch.testing.assert_close(data.batch[NLL_WEIGHT], correct / share)
    assert "anchor_rl/critic/policy_lam" in metrics


def test_vapo_state_needs_no_anchors_and_pvpo_refuses_unknown_prompts(anchors) -> None:
    trainer = trainer_for("pvpo", anchors)
    rows = trajectories(4)
    rows[0][1]["raw_prompt"] = [{"role": "user", "content": "never presampled"}]
    data = as_dataproto(rows, PER_PROMPT)
    with pytest.raises(KeyError, match="no anchor"):
        trainer.state.advantage_step(data, trainer.config.algorithm, 8)
    assert isinstance(MethodState(trainer_for("vapo", anchors).method_cfg), MethodState)


def test_resume_compares_the_checkpoints_anchor_key_and_method(anchors) -> None:
    """A checkpoint's method state loads only under the same anchors' key and method
    (verl_loop_checks.py refuses a changed key in a real resumed main_ppo)."""
    for method in ("pvpo", "v05"):
        state = trainer_for(method, anchors).state
        saved = state.state_dict()
        assert saved["anchor_key"] == anchors[1]
        state.load_state_dict(saved)
        with pytest.raises(ValueError, match="presample key other.*anchor_key=other"):
            state.load_state_dict({**saved, "anchor_key": "other"})
        with pytest.raises(ValueError, match="anchor_rl.method=vapo"):
            state.load_state_dict({**saved, "method": "vapo"})
    vapo = MethodState(trainer_for("vapo", anchors).method_cfg)
    vapo.load_state_dict(vapo.state_dict())
    with pytest.raises(ValueError, match="presample key"):
        vapo.load_state_dict({**vapo.state_dict(), "anchor_key": anchors[1]})


def test_rows_with_the_same_messages_and_another_gold_or_source_get_their_own_anchor(
    tmp_path,
) -> None:
    """Three rows with the same messages: two questions worded alike under one data source,
    whose golds the reference's answer matches (V_sta 1) and never matches (V_sta 0), and
    the first question under another data source whose reward function accepts nothing
    (V_sta 0; verl picks the function by data_source). Each is presampled as its own
    record, and each batch row finds its own anchor, with PVPO and with V0.5's anchor
    prior: the presampled ids are the keys the advantage step computes."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    golds = ["4", "no answer reaches this", "4"]
    sources = ["lenient", "lenient", "strict"]
    rows = [
        {
            "raw_prompt": copy.deepcopy(messages),
            "reward_model": {"ground_truth": g},
            "data_source": d,
        }
        for g, d in zip(golds, sources, strict=True)
    ]

    def sampler(records, n, first, seed):  # the reference always answers "4"
        scored.extend((r.answer, r.meta["data_source"]) for r in records)
        rewards = torch.tensor(
            [[float(r.answer == "4" and r.meta["data_source"] != "strict")] * n for r in records],
            dtype=torch.float64,
        )
        return rewards, rewards >= 1.0

    # a step: group 0 3 rollouts, groups 1 and 2 two each, all scored 0/1
    outcomes = [[1.0, 1.0, 0.0], [0.0, 0.0], [1.0, 0.0]]
    batch = []
    for g, rewards in enumerate(outcomes):
        for s, r in enumerate(rewards):
            fields = {
                "uid": f"uid{g}",
                "raw_prompt": copy.deepcopy(messages),
                "reward_model": {"ground_truth": golds[g], "style": "rule"},
                "data_source": sources[g],
                "response_mask": torch.ones(2, dtype=torch.int64),
                "rm_scores": torch.tensor([0.0, r]),
            }
            batch.append((f"uid{g}_{s}_0", fields))
    rewards = torch.tensor([r for rs in outcomes for r in rs])
    group = torch.tensor([g for g, rs in enumerate(outcomes) for _ in rs])
    algo = OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True})

    for method, node in [
        ("pvpo", {"pvpo": {"m": 4, "group_sampling": False}}),
        ("v05", {"pvpo": {"m": 4}, "v05": {"prior": "anchor"}}),
    ]:
        scored: list[tuple[str, str]] = []
        store = str(tmp_path / f"{method}.db")
        cfg = MethodConfig.from_verl({"anchor_rl": {"method": method, "store": store, **node}})
        key = AnchorKey(model="ref", tokenizer="tok", task="same-messages")
        state = prepare_method(cfg, rows, None, key, sampler).state
        # all three rows presampled, each against its own gold and data source
        assert sorted(scored) == sorted(zip(golds, sources, strict=True))
        assert sorted(stat.mean for stat in state.anchors.values()) == [0.0, 0.0, 1.0]
        expected_keys = [row_key(messages, g, d) for g, d in zip(golds, sources, strict=True)]
        assert sorted(state.anchors) == sorted(expected_keys)

        data = as_dataproto(batch, PER_PROMPT)
        state.advantage_step(data, algo, 3)
        mask = padded(batch, "response_mask").float()
        v_sta = torch.tensor([1.0, 0.0, 0.0])  # per group: only "4" under "lenient" is solved
        if method == "pvpo":
            baseline = v_sta[group]
        else:
            vc = cfg.v05.v05_config()
            baseline = fuse_groups(rewards, group, v_sta, vc).baseline.float()[group]
        expected = (rewards - baseline).unsqueeze(-1) * mask
        torch.testing.assert_close(data.batch["advantages"], expected)
        assert data.batch["advantages"][3:5].abs().sum() == 0  # r = 0 against its V_sta 0
        if method == "pvpo":  # group 2 ("strict"): not group 0's anchor although same gold
            torch.testing.assert_close(data.batch["advantages"][5:, -1], torch.tensor([1.0, 0.0]))


def test_a_batch_without_data_source_keys_as_presampled_rows_without_one(tmp_path) -> None:
    """Dataset rows without a data_source field are presampled under data_source None, and a
    batch without the field finds those anchors; the same rows in a batch that names a
    data source are other prompts (no anchor)."""
    rows = [{"raw_prompt": p, "reward_model": {"ground_truth": GOLD}} for p in PROMPTS]
    records, _ = dataset_records(rows)
    assert [r.id for r in records] == [row_key(p, GOLD, None) for p in PROMPTS]
    assert set(KEYS).isdisjoint(r.id for r in records)  # the SOURCE rows are other anchors

    def sampler(records, n, first, seed):  # the reference: ANCHOR_REWARDS by prompt
        rewards = torch.tensor(
            [ANCHOR_REWARDS[r.meta["row"]][:n] for r in records], dtype=torch.float64
        )
        return rewards, rewards >= 1.0

    cfg = MethodConfig.from_verl({"anchor_rl": {
        "method": "pvpo", "store": str(tmp_path / "anchors.db"),
        "pvpo": {"m": 4, "group_sampling": False},
    }})  # fmt: skip
    key = AnchorKey(model="ref", tokenizer="tok", task="no-source")
    state = prepare_method(cfg, rows, None, key, sampler).state
    algo = OmegaConf.create({"gamma": 1.0, "lam": 1.0, "norm_adv_by_std_in_grpo": True})

    batch = trajectories(8)
    names = [n for n in PER_PROMPT if n != "data_source"]
    data = as_dataproto(batch, names)
    assert "data_source" not in data.non_tensor_batch
    state.advantage_step(data, algo, 8)
    rewards = padded(batch, "rm_scores").sum(-1)
    anchor = torch.tensor([sum(ANCHOR_REWARDS[int(f["uid"][-1])]) / 4 for _, f in batch])
    expected = pvpo(rewards, anchor).unsqueeze(-1) * padded(batch, "response_mask")
    torch.testing.assert_close(data.batch["advantages"], expected)

    with pytest.raises(KeyError, match="no anchor"):  # batch rows under data_source SOURCE
        state.advantage_step(as_dataproto(batch, PER_PROMPT), algo, 8)


def test_a_batch_without_the_gold_answer_is_refused(anchors) -> None:
    trainer = trainer_for("pvpo", anchors)
    data = as_dataproto(trajectories(7), ["uid", "raw_prompt", "response_mask", "rm_scores"])
    with pytest.raises(KeyError, match="no reward_model field"):
        trainer.state.advantage_step(data, trainer.config.algorithm, 8)


# --- the whole advantage stage, through a real TransferQueue --------------------------------


@pytest.fixture(scope="module")
def transfer_queue():
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    tq.init(OmegaConf.create({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}}))
    yield tq
    tq.close()
    ray.shutdown()


def _stage(
    trainer, tq, rows, tags, read=("advantages", "returns")
) -> tuple[torch.Tensor, dict, dict]:
    from transfer_queue import KVBatchMeta

    keys = [k for k, _ in rows]
    tq.kv_batch_put(
        keys=keys,
        partition_id="train",
        fields=list_of_dict_to_tensordict([f for _, f in rows]),
        tags=tags,
    )
    metrics: dict = {}
    meta = trainer._compute_advantage(
        KVBatchMeta(keys=keys, tags=tags, partition_id="train"), metrics
    )
    # the handle the next stages get lists the new fields (verl hands workers only those)
    assert {"advantages", "returns", "rm_scores"} <= set(meta.fields)
    out = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=list(read))
    tq.kv_clear(keys=keys, partition_id="train")
    return out["advantages"].to_padded_tensor(0.0), out, metrics


def test_the_trainers_advantage_stage_writes_our_advantages_to_the_transfer_queue(
    anchors, transfer_queue
) -> None:
    tq = transfer_queue
    rows = trajectories(5)
    pad = dict(
        rows[0][1],
        uid="padABC",
        response_mask=torch.zeros(1, dtype=torch.int64),
        rm_scores=torch.zeros(1),
        responses=torch.ones(1, dtype=torch.long),
    )
    rows.append(("padABC_0_0", pad))
    tags = [{"status": "success"} for _ in rows[:-1]] + [{"status": "success", "is_padding": True}]
    trainer = trainer_for("pvpo", anchors)
    advantages, _, metrics = _stage(trainer, tq, rows, tags)

    rewards = padded(rows, "rm_scores").sum(-1)
    anchor = torch.tensor(
        [
            sum(ANCHOR_REWARDS[int(f["uid"][-1])]) / 4 if "pad" not in f["uid"] else 0.0
            for _, f in rows
        ]
    )
    expected = pvpo(rewards, anchor).unsqueeze(-1) * padded(rows, "response_mask")
    torch.testing.assert_close(advantages, expected)
    assert metrics["pvpo/anchor_mean"] == pytest.approx(anchor[:-1].mean().item())

    vapo = trainer_for("vapo", anchors)
    rows = trajectories(6, values=True)
    advantages, out, metrics = _stage(vapo, tq, rows, [{"status": "success"} for _ in rows])
    data = as_dataproto(rows, ["uid", "response_mask", "rm_scores", "values"])
    MethodState(vapo.method_cfg).advantage_step(data, vapo.config.algorithm, 16)
    torch.testing.assert_close(advantages, data.batch["advantages"])
    torch.testing.assert_close(out["returns"].to_padded_tensor(0.0), data.batch["returns"])
    assert "anchor_rl/critic/explained_variance" in metrics
    assert np.isfinite(metrics["anchor_rl/critic/value_mse"])


BETA = 0.5
"""``algorithm.kl_ctrl.kl_coef`` of the KL-in-the-reward tests."""


def _kl_in_reward_stage(method, anchors, tq, seed, read) -> tuple[list, torch.Tensor, dict, dict]:
    """The advantage stage of ``method`` with ``algorithm.use_kl_in_reward`` (verl's
    ``apply_kl_penalty``, ``kl_penalty=kl``, fixed beta :data:`BETA`) on trajectories carrying
    old and reference log-probs: (rows, advantages, the ``read`` fields, metrics)."""
    rows = trajectories(seed, values=method == "vapo")
    g = torch.Generator().manual_seed(seed)
    for _, f in rows:
        n = len(f["response_mask"])
        f["old_log_probs"] = -torch.rand(n, generator=g)
        f["ref_log_prob"] = -torch.rand(n, generator=g)
    trainer = trainer_for(
        method, anchors, "algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=kl",
        f"algorithm.kl_ctrl.kl_coef={BETA}",
    )  # fmt: skip
    tags = [{"status": "success"} for _ in rows]
    advantages, out, metrics = _stage(trainer, tq, rows, tags, read=read)
    assert metrics["actor/reward_kl_penalty_coeff"] == BETA
    return rows, advantages, out, metrics


def test_the_advantage_stage_takes_the_kl_in_the_reward(anchors, transfer_queue) -> None:
    """``algorithm.use_kl_in_reward`` (verl's ``apply_kl_penalty``, ``kl_penalty=kl``, fixed
    beta): the reward written back is the score minus beta * (old - ref) on response tokens,
    and PVPO's advantage is that reward's sum minus the prompt's anchor."""
    beta = BETA
    rows, advantages, out, _ = _kl_in_reward_stage(
        "pvpo", anchors, transfer_queue, 7, ("advantages", "token_level_rewards")
    )
    mask = padded(rows, "response_mask")
    kl = (padded(rows, "old_log_probs") - padded(rows, "ref_log_prob")) * mask
    expected = padded(rows, "rm_scores") - beta * kl
    torch.testing.assert_close(out["token_level_rewards"].to_padded_tensor(0.0), expected)
    assert (beta * kl.sum(-1)).abs().max() > 0.1  # the penalty moves the rewards
    anchor = torch.tensor([sum(ANCHOR_REWARDS[int(f["uid"][-1])]) / 4 for _, f in rows])
    torch.testing.assert_close(advantages, pvpo(expected.sum(-1), anchor).unsqueeze(-1) * mask)


def test_vapo_advantages_take_the_kl_in_the_reward(anchors, transfer_queue) -> None:
    """VAPO with ``algorithm.use_kl_in_reward`` through the whole advantage stage: the token
    rewards are score - beta * (old - ref) on every response token, the policy's advantages
    the length-adaptive GAE of those rewards on the critic's values (whitened), the critic's
    returns their reward-to-go (lambda 1); both recomputed here by hand to 1e-6, and unlike
    those of the scores alone. The float64 recomputation is the one the whole-loop check
    (``verl_loop_checks.py``) applies to VAPO's launches."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from verl_loop_checks import kl_in_reward, vapo_advantages_by_hand

    rows, advantages, out, _ = _kl_in_reward_stage(
        "vapo", anchors, transfer_queue, 8, ("advantages", "returns", "token_level_rewards")
    )
    mask = padded(rows, "response_mask").double()
    values = padded(rows, "values")
    record = {n: padded(rows, n) for n in ("response_mask", "old_log_probs", "ref_log_prob")}
    rewards = kl_in_reward({**record, "token_level_scores": padded(rows, "rm_scores")}, BETA)
    assert (rewards - padded(rows, "rm_scores").double()).abs().max() > 0.01
    torch.testing.assert_close(out["token_level_rewards"].to_padded_tensor(0.0).double(),
                               rewards, rtol=0, atol=1e-6)  # fmt: skip
    vapo = trainer_for("vapo", anchors).method_cfg.vapo  # the knobs the stage read
    assert vapo.policy_lam == "adaptive" and vapo.lam == 1.0 and vapo.whiten
    expected = vapo_advantages_by_hand(rewards, values, mask, vapo.lam_alpha, vapo.lam_min)
    torch.testing.assert_close(advantages.double(), expected, rtol=0, atol=1e-6)
    to_go = rewards.flip(-1).cumsum(-1).flip(-1) * mask  # KL is 0 on masked tokens
    torch.testing.assert_close(out["returns"].to_padded_tensor(0.0).double(), to_go,
                               rtol=0, atol=1e-6)  # fmt: skip
    scores_only = vapo_advantages_by_hand(padded(rows, "rm_scores"), values, mask,
                                          vapo.lam_alpha, vapo.lam_min)  # fmt: skip
    assert (scores_only - expected).abs().max() > 1e-2  # the KL moved the advantages
