"""The verl plug-in outside a training run: registration through verl's own plug-in mechanism
(in fresh processes), the registered policy loss against verl's, the config checks, and the
set-up of the method state (presampling and group sampling through anchor-rl's code)."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import subprocess
import sys
import types
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from PIL import Image
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla

from anchor_rl.algos.losses import policy_loss
from anchor_rl.anchors.keys import AnchorKey, canonical_json
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.integrations.verl import TRAINER
from anchor_rl.integrations.verl.config import (
    MethodConfig,
    PVPOSection,
    V05Section,
    VAPOSection,
    check_verl_config,
)
from anchor_rl.integrations.verl.data import ROW_KEY, dataset_records, plain, row_key, row_keys
from anchor_rl.integrations.verl.estimators import ppo_policy_loss
from anchor_rl.integrations.verl.trainer import prepare_method

PROBE = r"""
import json, logging, sys
logging.disable(logging.WARNING)
import verl  # the only import: verl's plug-in loading must register everything
from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, PPOTrainer
from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
trainer = TRAINER_REGISTRY.get("anchor_rl")
print(json.dumps({
    "trainer": None if trainer is None else f"{trainer.__module__}.{trainer.__name__}",
    "is_ppo_trainer": trainer is not None and issubclass(trainer, PPOTrainer),
    "estimators": {n: getattr(ADV_ESTIMATOR_REGISTRY.get(n), "__module__", None)
                   for n in ("anchor_rl_pvpo", "anchor_rl_v05")},
    "losses": {n: getattr(POLICY_LOSS_REGISTRY.get(n), "__module__", None) for n in ("anchor_rl_ppo",)},
    "agent_loops": {n: _agent_loop_registry.get(n) for n in ("anchor_rl_teacher",)},
    "plugin_loaded": "anchor_rl.integrations.verl.plugin" in sys.modules,
}))
"""


def _probe(**env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-W", "ignore", "-c", PROBE],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **env},
    )


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def test_a_bare_import_of_verl_registers_every_name_through_the_entry_point() -> None:
    on, off = _probe(), _probe(VERL_USE_EXTERNAL_PLUGINS="none")  # both run at once
    got, without = _result(on), _result(off)
    assert got == {
        "trainer": "anchor_rl.integrations.verl.trainer.AnchorRLTrainer",
        "is_ppo_trainer": True,
        "estimators": {
            "anchor_rl_pvpo": "anchor_rl.integrations.verl.estimators",
            "anchor_rl_v05": "anchor_rl.integrations.verl.estimators",
        },
        "losses": {"anchor_rl_ppo": "anchor_rl.integrations.verl.estimators"},
        "agent_loops": {
            "anchor_rl_teacher": {
                "_target_": "anchor_rl.integrations.verl.rollout.TeacherAgentLoop"
            }
        },
        "plugin_loaded": True,
    }
    # with verl's plug-in discovery off nothing of ours is there: the entry point did it
    assert without["trainer"] is None and not without["plugin_loaded"]
    assert without["estimators"] == {"anchor_rl_pvpo": None, "anchor_rl_v05": None}


def test_the_entry_point_is_declared_in_the_package_metadata() -> None:
    points = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert points.get("anchor_rl") == "anchor_rl.integrations.verl.plugin"


# --- the registered policy loss --------------------------------------------------------------


def _loss_inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=g) * 3
    new = old + torch.randn(B, T, generator=g) * 0.6
    adv = torch.randn(B, T, generator=g)
    lengths = torch.tensor([9, 4, 1, 7, 0, 3])
    mask = (torch.arange(T) < lengths[:, None]).float()
    return old, new, adv, mask


def _actor_config(clip_c: float | None, info: dict) -> types.SimpleNamespace:
    cfg = types.SimpleNamespace(
        clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=clip_c,
        global_batch_info=dict(info),
    )  # fmt: skip
    cfg.get = lambda name, default=None: getattr(cfg, name, default)
    return cfg


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_anchor_rl_ppo_equals_verl_vanilla_with_the_dual_clip_on(mode: str) -> None:
    old, new, adv, mask = _loss_inputs()
    # a micro-batch of a global batch of 40 tokens / 11 sequences over 2 data-parallel ranks
    info = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 11}
    ours, metrics = ppo_policy_loss(old, new, adv, mask, mode, _actor_config(3.0, info))
    theirs, _ = compute_policy_loss_vanilla(old, new, adv, mask, mode, _actor_config(3.0, info))
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert set(metrics) >= {"actor/anchor_rl/clipfrac_high", "actor/anchor_rl/clipfrac_low"}


def test_anchor_rl_ppo_without_the_dual_clip_is_anchor_rls_loss_on_verls_normaliser() -> None:
    old, new, adv, mask = _loss_inputs(1)
    adv = adv - 2.0  # negative advantages, where the dual clip binds
    info = {"dp_size": 2, "batch_num_tokens": 40, "global_batch_size": 11}
    ours, _ = ppo_policy_loss(old, new, adv, mask, "token-mean", _actor_config(None, info))
    local, _ = policy_loss(new, old, adv, mask, clip_low=0.2, clip_high=0.28, agg="token-mean")
    torch.testing.assert_close(ours, local * mask.sum() / 40 * 2)
    vanilla, _ = compute_policy_loss_vanilla(
        old, new, adv, mask, "token-mean", _actor_config(3.0, info)
    )
    assert not torch.allclose(ours, vanilla)  # verl's vanilla always dual-clips


def test_anchor_rl_ppo_refuses_what_it_cannot_mean() -> None:
    old, new, adv, mask = _loss_inputs()
    with pytest.raises(ValueError, match="rollout-correction"):
        ppo_policy_loss(
            old, new, adv, mask, "token-mean", _actor_config(None, {}), torch.ones_like(old)
        )
    with pytest.raises(ValueError, match="aggregates with"):
        ppo_policy_loss(old, new, adv, mask, "token-sum", _actor_config(None, {}))


# --- config checks ------------------------------------------------------------------------


def _verl_cfg(method: str, **extra: object) -> OmegaConf:
    base = {
        "algorithm": {
            "adv_estimator": {"pvpo": "anchor_rl_pvpo", "v05": "anchor_rl_v05"}.get(method, "gae"),
            "lam": 1.0,
        },
        "actor_rollout_ref": {"rollout": {"n": 4}},
        "critic": {"enable": None},
        "anchor_rl": {"method": method},
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.create(extra))


@pytest.mark.parametrize(
    ("method", "extra", "match"),
    [
        (
            "pvpo",
            {"algorithm": {"adv_estimator": "grpo"}},
            "algorithm.adv_estimator=anchor_rl_pvpo",
        ),
        ("v05", {"algorithm": {"filter_groups": {"enable": True}}}, "filter_groups"),
        ("vapo", {"algorithm": {"lam": 0.95}}, "anchor_rl.vapo.policy_lam"),
        ("vapo", {"critic": {"enable": False}}, "critic.enable=true"),
        (
            "pvpo",
            {
                "anchor_rl": {"pvpo": {"teacher": "field:x"}},
                "actor_rollout_ref": {"rollout": {"n": 1}},
            },
            "rollout.n >= 2",
        ),
        ("v05", {"actor_rollout_ref": {"rollout": {"n": 32}}}, "k_max"),
    ],
)
def test_combinations_that_cannot_mean_what_they_say_are_refused(method, extra, match) -> None:
    cfg = _verl_cfg(method, **extra)
    with pytest.raises(ValueError, match=match):
        check_verl_config(cfg, MethodConfig.from_verl(cfg))


@pytest.mark.parametrize("budget", ["adaptive", "fixed"])
def test_v05_refuses_more_first_rollouts_than_k_max_with_either_budget(budget) -> None:
    """k_max caps a prompt's rollouts, top-ups included; rollout.n (k_init) above it breaks the
    cap before any top-up, so a fixed budget is refused too (as anchor-rl's trainer does)."""
    node = {"v05": {"budget": budget, "k_max": 8}}
    cfg = _verl_cfg("v05", anchor_rl=node, actor_rollout_ref={"rollout": {"n": 12}})
    with pytest.raises(ValueError) as err:
        check_verl_config(cfg, MethodConfig.from_verl(cfg))
    message = str(err.value)
    assert "actor_rollout_ref.rollout.n=12" in message and "anchor_rl.v05.k_max=8" in message
    assert f"budget: {budget}" in message
    assert "rollout.n <= 8" in message and "k_max to at least 12" in message
    at_cap = _verl_cfg("v05", anchor_rl=node, actor_rollout_ref={"rollout": {"n": 8}})
    check_verl_config(at_cap, MethodConfig.from_verl(at_cap))  # n == k_max is fine


@pytest.mark.parametrize(
    ("method", "node", "named", "fix"),
    [
        ("v05", {"v05": {"budget": "fixed", "top_up_rounds": 4}}, ["top_up_rounds"], "budget"),
        ("v05", {"v05": {"budget": "fixed", "cost": 0.01}}, ["cost"], "budget=adaptive"),
        ("vapo", {"vapo": {"policy_lam": 0.9, "lam_alpha": 0.1}}, ["lam_alpha"], "adaptive"),
        ("vapo", {"vapo": {"policy_lam": 0.9, "lam_min": 0.5}}, ["lam_min"], "policy_lam"),
    ],
)
def test_knobs_the_methods_other_settings_switch_off_are_refused(method, node, named, fix) -> None:
    """As anchor-rl's trainer refuses them: top-up knobs with a fixed budget, the adaptive
    lambda's knobs with a numeric policy lambda; the same knobs pass once they are read."""
    cfg = _verl_cfg(method, anchor_rl=node, critic={"enable": method == "vapo"})
    with pytest.raises(ValueError, match="no effect") as err:
        check_verl_config(cfg, MethodConfig.from_verl(cfg))
    message = str(err.value)
    assert all(f"anchor_rl.{method}.{name}" in message for name in named) and fix in message
    section = dict(node[method])
    section.update({"budget": "adaptive"} if method == "v05" else {"policy_lam": "adaptive"})
    read = _verl_cfg(method, anchor_rl={method: section}, critic={"enable": method == "vapo"})
    check_verl_config(read, MethodConfig.from_verl(read))


def test_v05s_own_rules_apply_in_the_nodes_names() -> None:
    """V05Config.errors' rule for history knobs without a history layer, as anchor-rl's trainer
    refuses it."""
    cfg = _verl_cfg("v05", anchor_rl={"v05": {"prior": "anchor", "history_gamma": 0.5}})
    with pytest.raises(ValueError, match=r"^anchor_rl\.v05\.history_gamma has no effect: "):
        check_verl_config(cfg, MethodConfig.from_verl(cfg))


def test_the_method_node_is_validated_with_anchor_rls_own_rules() -> None:
    with pytest.raises(ValueError, match="knn prior"):
        MethodConfig.from_verl({"anchor_rl": {"method": "v05", "v05": {"prior": "knn+history"}}})
    with pytest.raises(ValueError, match="field:PATH"):
        MethodConfig.from_verl({"anchor_rl": {"method": "pvpo", "pvpo": {"teacher": "hf:big"}}})
    with pytest.raises(ValueError):  # CriticConfig's bounds: a lambda lies in [0, 1]
        MethodConfig.from_verl({"anchor_rl": {"method": "vapo", "vapo": {"lam": 1.5}}})
    with pytest.raises(ValueError, match="pvpo.refresh_every: the verl trainer does not refresh"):
        MethodConfig.from_verl({"anchor_rl": {"method": "pvpo", "pvpo": {"refresh_every": 50}}})
    with pytest.raises(ValueError, match="anchor-rl train and the TRL plug-in refresh"):
        MethodConfig.from_verl(
            {"anchor_rl": {"method": "pvpo", "pvpo": {"refresh_mode": "policy"}}}
        )
    with pytest.raises(ValueError, match=r"v05\.reward_range\n.*lo < hi, got \[1\.0, 0\.0\]"):
        MethodConfig.from_verl({"anchor_rl": {"method": "v05", "v05": {"reward_range": [1, 0]}}})
    with pytest.raises(ValueError, match="anchor_rl. config node"):
        MethodConfig.from_verl({"trainer": {"v1": {"trainer_mode": TRAINER}}})
    check_verl_config(_verl_cfg("vapo"), MethodConfig.from_verl(_verl_cfg("vapo")))  # fine


@pytest.mark.parametrize(
    ("method", "node", "named"),
    [
        (
            "v05",
            {"pvpo": {"teacher": "field:extra_info.answer", "group_sampling": False}},
            ["anchor_rl.pvpo.group_sampling", "anchor_rl.pvpo.teacher"],
        ),
        ("v05", {"pvpo": {"keep_unsolved": True}}, ["anchor_rl.pvpo.keep_unsolved"]),
        ("v05", {"v05": {"prior": "history"}, "pvpo": {"m": 4}}, ["anchor_rl.pvpo.m"]),
        ("v05", {"vapo": {"nll_coef": 0.5}}, ["anchor_rl.vapo.nll_coef"]),
        (
            "vapo",
            {"pvpo": {"m": 64, "anchor_key": "deadbeef"}, "v05": {"budget": "fixed"}},
            ["anchor_rl.pvpo.m", "anchor_rl.pvpo.anchor_key", "anchor_rl.v05.budget"],
        ),
        (
            "pvpo",
            {"v05": {"prior": "history", "k_max": 2}, "vapo": {"nll_coef": 0.5}},
            ["anchor_rl.v05.prior", "anchor_rl.v05.k_max", "anchor_rl.vapo.nll_coef"],
        ),
    ],
)
def test_knobs_of_sections_the_method_does_not_read_are_refused(method, node, named) -> None:
    cfg = _verl_cfg(method, anchor_rl=node, critic={"enable": method == "vapo"})
    with pytest.raises(ValueError, match=f"anchor_rl.method={method}, which does not read") as err:
        check_verl_config(cfg, MethodConfig.from_verl(cfg))
    message = str(err.value)
    assert all(name in message for name in named)


@pytest.mark.parametrize("method", ["pvpo", "v05", "vapo"])
def test_every_knob_at_its_default_passes_for_every_method(method) -> None:
    every = {
        "pvpo": PVPOSection().model_dump(),
        "v05": V05Section().model_dump(),
        "vapo": VAPOSection().model_dump(),
    }  # as the example config lists them
    cfg = _verl_cfg(method, anchor_rl=every, critic={"enable": method == "vapo"})
    check_verl_config(cfg, MethodConfig.from_verl(cfg))
    # what a method reads may be set
    reads = {
        "pvpo": {"pvpo": {"m": 4, "teacher": "field:x", "keep_unsolved": True}},
        "v05": {"pvpo": {"m": 4, "anchor_key": "abc"}, "v05": {"budget": "fixed"}},
        "vapo": {"vapo": {"nll_coef": 0.0}},
    }[method]
    cfg = _verl_cfg(method, anchor_rl=reads, critic={"enable": method == "vapo"})
    check_verl_config(cfg, MethodConfig.from_verl(cfg))


def _image_prompt(png: bytes) -> list[dict]:
    """A multimodal row's raw_prompt as verl's dataset builds it (a fresh PIL image per load)."""
    image = {"bytes": png, "image": Image.open(io.BytesIO(png))}
    text = {"type": "text", "text": "What colour?"}
    return [{"role": "user", "content": [{"type": "image", **image}, text]}]


def messages_only_key(raw_prompt) -> str:
    """The id an earlier version gave a row's anchor: its messages alone, without the gold."""
    return hashlib.sha256(canonical_json(plain(raw_prompt)).encode()).hexdigest()[:32]


def no_source_key(raw_prompt, gold) -> str:
    """The id the version before gave a row's anchor: messages and gold, no data_source."""
    payload = canonical_json({"raw_prompt": plain(raw_prompt), "ground_truth": plain(gold)})
    return hashlib.sha256(payload.encode()).hexdigest()[:32]


def test_prompts_with_an_image_are_refused_and_text_parts_are_keyed_stably() -> None:
    buf = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(buf, format="PNG")
    with pytest.raises(ValueError, match=r"content\[0\] is a 'image' part: .*text-only"):
        row_key(_image_prompt(buf.getvalue()), None, None)
    with pytest.raises(ValueError, match="text-only"):
        dataset_records([{"raw_prompt": _image_prompt(buf.getvalue())}])
    with pytest.raises(ValueError, match=r"raw_prompt\[0\]\.image holds a PngImageFile"):
        row_key([{"role": "user", "content": "hi", "image": Image.open(buf)}], None, None)
    parts = [{"role": "user", "content": [{"type": "text", "text": "What colour?"}]}]
    assert row_key(parts, "4", "gsm8k") == row_key(copy.deepcopy(parts), "4", "gsm8k")
    assert row_key("a plain prompt", 4, None) == row_key("a plain prompt", 4, None)


# --- set-up: presampling and group sampling -----------------------------------------------

ROWS = [
    {"raw_prompt": [{"role": "user", "content": "always solved"}], "sol": "4 #### 4"},
    {"raw_prompt": [{"role": "user", "content": "never solved, with a solution"}], "sol": "#### 7"},
    {"raw_prompt": [{"role": "user", "content": "sometimes solved"}], "sol": "#### 1"},
    {"raw_prompt": [{"role": "user", "content": "never solved, no solution"}], "sol": ""},
    {"raw_prompt": [{"role": "user", "content": "sometimes solved"}], "sol": "#### 1"},  # a repeat
]
REWARDS = {0: [1.0, 1.0, 1.0, 1.0], 1: [0.0, 0.0, 0.0, 0.0], 2: [1.0, 0.0, 0.0, 1.0], 3: [0.0] * 4}


def _gold(row: dict) -> str:
    return row["sol"].split("####")[-1].strip()


SOURCE = "openai/gsm8k"
"""Every _rows() row's data_source (verl's reward picks its scoring function by it)."""


def _key(row: dict) -> str:
    return row_key(row["raw_prompt"], _gold(row), SOURCE)


def _rows() -> list[dict]:
    return [
        {
            **r,
            "data_source": SOURCE,
            "reward_model": {"ground_truth": _gold(r)},
            "extra_info": {"answer": r["sol"]},
        }
        for r in ROWS
    ]


def test_presampling_and_group_sampling_decide_the_anchors_and_the_rows_trained_on(
    tmp_path, tokenizer
) -> None:
    by_key = {_key(r): REWARDS[i] for i, r in enumerate(ROWS[:4])}
    calls = []

    def sampler(records, n, first, seed):  # verl's rollout stands in here: fixed rewards
        calls.append(len(records))
        rewards = torch.tensor([by_key[r.id][:n] for r in records], dtype=torch.float64)
        return rewards, rewards >= 1.0

    cfg = MethodConfig.from_verl({"anchor_rl": {
        "method": "pvpo", "store": str(tmp_path / "anchors.db"),
        "pvpo": {"m": 4, "teacher": "field:extra_info.answer"},
    }})  # fmt: skip
    key = AnchorKey(model="ref", tokenizer="tok", task="gsm8k")
    prepared = prepare_method(cfg, _rows(), tokenizer, key, sampler)
    assert sum(calls) == 4  # four distinct prompts (the repeat, same gold, shares its anchor)
    assert prepared.rows == [1, 2, 4]  # solved and unsolvable-without-solution dropped
    state = prepared.state
    assert state.anchor_of([_key(ROWS[2])]).tolist() == [0.5]
    (teacher,) = state.trajectories.values()
    assert teacher.prompt_id == _key(ROWS[1])
    ids = tokenizer.encode("#### 7", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert teacher.token_ids.tolist() == ids and teacher.logprobs.abs().sum() == 0
    # a second run finds everything in the store and samples nothing
    again = prepare_method(cfg, _rows(), tokenizer, key, sampler)
    assert sum(calls) == 4 and again.rows == prepared.rows
    assert again.presampled.rollouts == 0


def test_anchors_under_a_given_key_are_read_and_missing_prompts_refused(tmp_path) -> None:
    store_file = tmp_path / "anchors.db"
    key = AnchorKey(model="offline", tokenizer="tok")
    with AnchorStore(store_file) as store:
        store.add_rollouts(key, [_key(ROWS[0])], [[1.0, 0.0, 0.0]], [[1, 0, 0]])
    cfg = MethodConfig.from_verl({"anchor_rl": {
        "method": "pvpo", "store": str(store_file), "pvpo": {"anchor_key": key.digest, "group_sampling": False},
    }})  # fmt: skip
    state = prepare_method(cfg, _rows()[:1]).state
    assert state.anchor_of([_key(ROWS[0])]).tolist() == pytest.approx([1 / 3])
    with pytest.raises(KeyError, match="have no anchor"):
        prepare_method(cfg, _rows()[:2])
    # an anchor stored under the messages alone (an older id scheme) is never picked up
    with AnchorStore(store_file) as store:
        store.add_rollouts(key, [messages_only_key(ROWS[1]["raw_prompt"])], [[1.0]], [[1]])
    with pytest.raises(KeyError, match="reward_model.ground_truth"):
        prepare_method(cfg, _rows()[:2])
    # nor one stored under messages and gold without the data_source (the scheme before)
    with AnchorStore(store_file) as store:
        store.add_rollouts(
            key, [no_source_key(ROWS[1]["raw_prompt"], _gold(ROWS[1]))], [[1.0]], [[1]]
        )
    with pytest.raises(KeyError, match="without the data_source"):
        prepare_method(cfg, _rows()[:2])


def test_rows_are_keyed_by_their_messages_and_their_gold_answer() -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rows = [
        {"raw_prompt": messages, "reward_model": {"ground_truth": "4"}},
        {"raw_prompt": copy.deepcopy(messages), "reward_model": {"ground_truth": "5"}},
        {"raw_prompt": copy.deepcopy(messages), "reward_model": {"ground_truth": "4"}},
    ]
    records, indices = dataset_records(rows)
    assert [r.answer for r in records] == ["4", "5"]
    assert [indices[r.id] for r in records] == [[0, 2], [1]]
    assert row_key(messages, "4", None) != row_key(messages, "5", None)
    assert messages_only_key(messages) not in (
        row_key(messages, "4", None),
        row_key(messages, None, None),
    )
    assert row_key(messages, 4, None) != row_key(messages, "4", None)  # verl's reward sees types
    with pytest.raises(KeyError, match="no reward_model field"):
        dataset_records([{"raw_prompt": messages}])
    with pytest.raises(ValueError, match="ground_truth holds a"):
        dataset_records([{"raw_prompt": messages, "reward_model": {"ground_truth": object()}}])


def test_rows_are_keyed_by_their_data_source_too() -> None:
    """verl's reward managers pick the scoring function by the row's data_source, so the same
    messages and gold under two data sources are two anchors; a row without the field keys
    as data_source None, and a batch without the field keys its rows the same way."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    rm = {"ground_truth": "4", "style": "rule"}
    rows = [
        {"raw_prompt": messages, "reward_model": rm, "data_source": "openai/gsm8k"},
        {"raw_prompt": copy.deepcopy(messages), "reward_model": rm, "data_source": "math_dapo"},
        {"raw_prompt": copy.deepcopy(messages), "reward_model": rm},  # no data_source
        {"raw_prompt": copy.deepcopy(messages), "reward_model": rm, "data_source": None},
        {"raw_prompt": copy.deepcopy(messages), "reward_model": rm, "data_source": "openai/gsm8k"},
    ]
    records, indices = dataset_records(rows)
    assert [indices[r.id] for r in records] == [[0, 4], [1], [2, 3]]
    assert [r.meta["data_source"] for r in records] == ["openai/gsm8k", "math_dapo", None]
    assert len({r.id for r in records}) == 3
    assert row_key(messages, "4", "openai/gsm8k") != row_key(messages, "4", "math_dapo")
    assert row_key(messages, "4", "openai/gsm8k") != row_key(messages, "4", None)
    # the id scheme before this one (no data_source) never collides with this one's ids
    assert no_source_key(messages, "4") not in {r.id for r in records}
    assert ROW_KEY != "sha256(raw_prompt, reward_model.ground_truth)" and "data_source" in ROW_KEY

    # the training side (a batch's fields, as verl's non_tensor_batch holds them) agrees
    raw = [r["raw_prompt"] for r in rows]
    gold = [r["reward_model"] for r in rows]
    sources = np.array(["openai/gsm8k", "math_dapo", None, None, "openai/gsm8k"], dtype=object)
    assert row_keys(raw, gold, sources) == [records[i].id for i in (0, 1, 2, 2, 0)]
    # a batch with no data_source field keys its rows as dataset rows without one
    assert row_keys(raw[2:4], gold[2:4], None) == [records[2].id] * 2
    assert row_keys(raw[:1], gold[:1], None) != [records[0].id]
    with pytest.raises(ValueError, match="2 raw_prompt but 1 data_source"):
        row_keys(raw[:2], gold[:2], ["openai/gsm8k"])
    with pytest.raises(ValueError, match=r"data_source holds a object: .*data_source too"):
        dataset_records([{"raw_prompt": messages, "reward_model": rm, "data_source": object()}])
