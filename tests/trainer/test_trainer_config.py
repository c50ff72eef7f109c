"""Config: presets load and validate, overrides parse and coerce, errors name the field."""

from __future__ import annotations

import pytest

from anchor_rl.trainer.config import (
    ConfigError,
    TrainConfig,
    apply_overrides,
    build_config,
    describe,
    field_paths,
    load_config,
)
from anchor_rl.trainer.presets import parse_override, preset_names, read_preset

PRESETS = ["dapo", "drgrpo", "grpo", "reinforce_pp", "reinforce_pp_baseline", "rloo"]
"""The baseline presets; PVPO, V0.5 and critic presets come with their own tests."""


def test_builtin_presets_are_listed() -> None:
    assert set(PRESETS) <= set(preset_names())


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_loads_and_validates(name: str) -> None:
    cfg = load_config(name)
    assert cfg.preset == name
    # a preset sets only algorithm knobs: run-scale settings stay at the defaults
    assert cfg.rollout == TrainConfig().rollout
    assert cfg.optim == TrainConfig().optim


def test_presets_set_what_their_papers_set() -> None:
    grpo, dr, dapo, rloo, rpp, rppb = (
        load_config(n)
        for n in ["grpo", "drgrpo", "dapo", "rloo", "reinforce_pp", "reinforce_pp_baseline"]
    )
    assert (grpo.advantage.estimator, grpo.loss.agg, grpo.kl.coef, grpo.kl.kind) == (
        "grpo",
        "seq-mean-token-mean",
        0.04,
        "k3",
    )
    assert (dr.advantage.estimator, dr.loss.agg, dr.kl.coef) == (
        "drgrpo",
        "seq-mean-token-sum-norm",
        0.0,
    )
    assert (dapo.loss.clip_low, dapo.loss.clip_high, dapo.loss.agg, dapo.kl.coef) == (
        0.2,
        0.28,
        "token-mean",
        0.0,
    )
    assert dapo.filter.kind == "dynamic" and dapo.reward.overlong_cache > 0
    assert rloo.advantage.estimator == "rloo" and rloo.kl.in_reward
    assert rpp.advantage.estimator == "reinforce_pp" and rpp.kl.in_reward
    assert rppb.advantage.estimator == "reinforce_pp_baseline"


@pytest.mark.parametrize(
    ("text", "key", "value"),
    [
        ("rollout.n=16", "rollout.n", 16),
        ("kl.coef=0.04", "kl.coef", 0.04),
        ("log.wandb=true", "log.wandb", True),
        ("model=sft:tiny", "model", "sft:tiny"),
        ("model=/tmp/some dir", "model", "/tmp/some dir"),
        ('task="arithmetic"', "task", "arithmetic"),
        ("optim.betas=[0.9, 0.95]", "optim.betas", [0.9, 0.95]),
        ("loss.clip_c=none", "loss.clip_c", None),
        (" steps = 3 ", "steps", 3),
    ],
)
def test_parse_override(text: str, key: str, value: object) -> None:
    assert parse_override(text) == (key, value)


def test_override_without_equals_is_rejected() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        parse_override("rollout.n")


def test_overrides_are_applied_and_coerced() -> None:
    cfg = load_config(
        "grpo",
        [
            "rollout.n=4",
            "kl.coef=0",
            "optim.lr=3e-4",
            "optim.betas=[0.9, 0.95]",
            "task_args.digits=3",
        ],
    )
    assert cfg.rollout.n == 4 and cfg.kl.coef == 0.0 and cfg.optim.lr == 3e-4
    assert cfg.optim.betas == (0.9, 0.95)
    assert cfg.task_args == {"digits": 3}
    assert cfg.kl.kind == "k3"  # untouched preset values survive
    # a numeric string is coerced by the field's type
    assert load_config(None, ['steps="7"']).steps == 7


def test_unknown_key_is_rejected_with_a_suggestion() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'rollout\.nn'.*rollout\.n"):
        load_config("grpo", ["rollout.nn=3"])


def test_section_is_not_a_value() -> None:
    with pytest.raises(ConfigError, match="unknown config key 'rollout'"):
        load_config(None, ["rollout=3"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("rollout.n=0", "rollout.n"),
        ("loss.clip_low=2", "loss.clip_low"),
        ("kl.kind=k4", "kl.kind"),
        ("loss.agg=sum", "loss.agg"),
        ("steps=abc", "steps"),
        ("optim.lr=-1", "optim.lr"),
        ("loss.clip_c=0.5", "loss.clip_c"),
        ("eval.prompts=true", "eval.prompts"),  # not read as 1
        ("pvpo.m=true", "pvpo.m"),
        ("reward.task_weight=nan", "reward.task_weight"),
        ("reward.weights=[1.0, inf]", "reward.weights.1"),
        ("optim.betas=[1.5, 0.9]", "optim.betas.0"),
        ("seed=-1", "seed"),  # numpy and torch take 0 <= seed < 2**32: refused now, not at run
        ("seed=4294967296", "seed"),
        ("rollout.engine_args.max_batch=0", "rollout.engine_args.max_batch=0"),
        ("rollout.engine_args.decode=foo", "rollout.engine_args.decode='foo'"),
        ("rollout.engine_args.precision=fp8", "rollout.engine_args.precision='fp8'"),
        ('rollout.engine_args.max_batch="8"', "rollout.engine_args.max_batch='8'"),  # unconverted
    ],
)
def test_invalid_values_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("grpo", [override])
    assert f"{field}:" in str(info.value)


def test_engine_options_are_checked_against_the_engines_annotations() -> None:
    with pytest.raises(ConfigError, match="should be 'auto', 'static', 'hf' or 'graph'"):
        load_config("grpo", ["rollout.engine_args.decode=foo"])
    with pytest.raises(ConfigError, match=r"max_batch=0: .* \(the 'ray' engine\)"):
        load_config("grpo", ["cluster.rollout_workers=2", "rollout.engine_args.max_batch=0"])
    cfg = load_config(
        "grpo", ["rollout.engine_args.decode=static", "rollout.engine_args.max_batch=8"]
    )
    assert cfg.engine == ("hf", {"decode": "static", "max_batch": 8})


def test_a_device_torch_does_not_know_is_refused_with_the_config() -> None:
    with pytest.raises(ConfigError, match="device='banana' is not a torch device"):
        load_config("grpo", ["device=banana"])
    assert load_config("grpo", ["device=cuda:1"]).device == "cuda:1"  # checked at run time


def test_a_preset_is_chosen_with_the_flag_not_relabelled_by_an_override() -> None:
    with pytest.raises(ConfigError, match="start from a preset with --preset dapo"):
        load_config("grpo", ["preset=dapo"])
    assert load_config("dapo").preset == "dapo"


def test_asynchronous_rollouts_on_the_ray_engine_named_directly() -> None:
    cfg = load_config(
        "grpo", ["rollout.engine=ray", "rollout.engine_args.workers=2", "cluster.async_steps=1"]
    )
    assert cfg.engine == ("ray", {"workers": 2}) and cfg.cluster.async_steps == 1


def test_overlong_window_is_a_fraction_of_the_budget() -> None:
    assert load_config("dapo", ["rollout.max_new_tokens=96"]).overlong_cache_tokens == 19
    assert load_config("dapo", ["rollout.max_new_tokens=2"]).overlong_cache_tokens == 1
    assert load_config("grpo").overlong_cache_tokens == 0
    with pytest.raises(ConfigError, match="reward.overlong_cache:"):
        load_config("dapo", ["reward.overlong_cache=1.5"])


def test_unknown_key_in_a_table_is_rejected() -> None:
    with pytest.raises(ConfigError, match="kl.beta: unknown key"):
        build_config({"kl": {"beta": 0.1}})


def test_unknown_preset_lists_the_presets(tmp_path) -> None:
    with pytest.raises(ConfigError, match="grpo"):
        read_preset("nope")
    custom = tmp_path / "mine.toml"
    custom.write_text("[kl]\ncoef = 0.5\n")
    cfg = load_config(str(custom))
    assert cfg.preset == "mine" and cfg.kl.coef == 0.5
    for path in (tmp_path / "missing.toml", tmp_path / "missing"):  # a path, not a name
        with pytest.raises(ConfigError, match=f"preset file {path} does not exist"):
            read_preset(str(path))


def test_apply_overrides_does_not_mutate_its_input() -> None:
    table = {"kl": {"coef": 0.1}}
    out = apply_overrides(table, {"kl.coef": 0.2})
    assert table == {"kl": {"coef": 0.1}} and out == {"kl": {"coef": 0.2}}


def test_every_field_is_documented() -> None:
    rows = describe()
    assert {key for key, _, _ in rows} == set(field_paths())
    undocumented = [key for key, _, doc in rows if not doc]
    assert undocumented == []


def test_docs_list_every_field_with_its_default() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    missing = [key for key, default, _ in describe() if f"| `{key}` | `{default}` |" not in doc]
    assert missing == []
    # the table is written from the fields' own docs (scripts/update_config_table.py): an
    # edit to the table alone would be lost at the next regeneration
    stale = [
        key
        for key, default, meaning in describe()
        if f"| `{key}` | `{default}` | {meaning} |" not in doc
    ]
    assert stale == [], "run python scripts/update_config_table.py"


# Every combination the config refuses: (the docs table's first column, preset, overrides,
# part of the one-line message). docs/training.md, "Refused combinations", lists each row.
REFUSED = [
    ("`critic.*` without a critic", "grpo", ["critic.lr=1e-3"], "critic.lr has no effect"),
    ("`v05.*` without V0.5", "grpo", ["v05.k_max=8"], "v05.k_max has no effect"),
    ("`pvpo.*` without anchors", "grpo", ["pvpo.m=4"], "pvpo.m has no effect: the run presamples no anchors"),
    ("group-sampling `pvpo.*` with only V0.5's anchor prior", "v05", ["pvpo.teacher=none"],
     "uses only pvpo.m, pvpo.prompts, pvpo.store, pvpo.presample_batch and pvpo.presample_seed"),
    ("V0.5's anchor prior with `pvpo.refresh_every`", "v05", ["pvpo.refresh_every=10"], "set pvpo.refresh_every=0"),
    ("`rollout.n=1` with a group baseline", "grpo", ["rollout.n=1"], "every advantage is 0"),
    ("`filter.kind=dynamic` with a per-prompt baseline", "pvpo", ["filter.kind=dynamic"],
     "filter.kind=dynamic with advantage.estimator=pvpo"),
    ("`filter.max_rounds` or `filter.metric` without dynamic sampling", "grpo", ["filter.max_rounds=5"],
     "filter.max_rounds has no effect: only dynamic sampling reads it"),
    ("`filter.max_rounds` or `filter.metric` without dynamic sampling", "grpo",
     ["filter.metric=reward", "filter.max_rounds=2"], "filter.max_rounds, filter.metric have no effect"),
    ("`advantage.gamma` without token returns", "grpo", ["advantage.gamma=0.9"], "advantage.gamma has no effect"),
    ("`ref_model` that nothing reads", "grpo", ["kl.coef=0", "kl.track=false", "ref_model=random:tiny"],
     "ref_model has no effect"),
    ("`rollout.budget=adaptive` without V0.5", "grpo", ["rollout.budget=adaptive"], 'needs advantage.estimator="v05"'),
    ("`rollout.n` above `v05.k_max`", "v05", ["rollout.n=20"], "exceeds v05.k_max = 16"),
    ("empty `v05.reward_range`", "v05", ["v05.reward_range=[1, 0]"], "lo < hi"),
    ("overlong punishment outside `v05.reward_range`", "v05", ["reward.overlong_cache=0.2"],
     "set v05.reward_range=[-1, 1.0]"),
    ("`v05.cost`, `v05.top_up_rounds` with a fixed budget", "v05", ["rollout.budget=fixed", "v05.cost=0.01"],
     "v05.cost has no effect"),
    ("`v05.knn_*` without the knn base", "v05", ["v05.knn_top_k=4"], "has no knn base"),
    ("`v05.history_*` without the history layer", "v05", ["v05.prior=anchor", "v05.history_gamma=0.9"],
     "has no history layer"),
    ("`pvpo.teacher_model` without an http teacher", "pvpo", ["pvpo.teacher_model=big"],
     "pvpo.teacher_model has no effect"),
    ("`pvpo.teacher_tries` for a teacher that does not sample", "pvpo", ["pvpo.teacher_tries=2"], "does not sample"),
    ("teacher settings without group sampling", "pvpo", ["filter.kind=none", "pvpo.keep_unsolved=true"],
     "belong to group sampling"),
    ("`pvpo.refresh_mode` without refreshes", "pvpo", ["pvpo.refresh_mode=policy"], "never refreshes"),
    ("`pvpo.teacher=oracle:reference` with `rollout.top_p < 1`", "pvpo",
     ["pvpo.teacher=oracle:reference", "rollout.top_p=0.9"], "scores the trace without a nucleus"),
    ("`rollout.n=1` with a teacher", "pvpo", ["rollout.n=1"], "here the policy's only one"),
    ("overlong punishment with the static anchor", "pvpo", ["reward.overlong_cache=0.2"],
     "drop reward.overlong_cache"),
    ("an `http:` teacher without `pvpo.teacher_model`", "pvpo", ["pvpo.teacher=http:http://127.0.0.1:9/v1"],
     "needs pvpo.teacher_model"),
    ("`critic.lam_alpha`, `critic.lam_min` without the adaptive lambda", "ppo", ["critic.lam_alpha=0.1"],
     "length-adaptive lambda"),
    ("`critic.pretrain_ev_threshold` without value pretraining", "ppo", ["critic.pretrain_ev_threshold=0.5"],
     "switches value pretraining off"),
    ("`rollout.engine_args.workers` / `.address` with `cluster.rollout_workers`", "grpo",
     ["cluster.rollout_workers=2", "rollout.engine_args.address=auto"], "set them there"),
    ("`rollout.engine_args` values the engine does not take (`decode=foo`, `precision=fp8`, "
     "`max_batch=0`)", "grpo", ["rollout.engine_args.precision=fp8"], "should be 'model' or 'bf16'"),
    ("`rollout.release_memory` with Ray workers or the `http` engine", "grpo",
     ["cluster.rollout_workers=2", "rollout.release_memory=true"], "samples in other processes"),
    ("`cluster.learners > 1` with `device=cuda:N` (N > 0) or a device other than `cpu`/`cuda`",
     "grpo", ["cluster.learners=2", "device=cuda:1"], "the ranks take GPUs 0..N-1"),
]  # fmt: skip


@pytest.mark.parametrize(("combination", "preset", "overrides", "message"), REFUSED)
def test_each_refused_combination_names_the_field_and_the_fix(
    combination, preset, overrides, message
) -> None:
    load_config(preset)  # the preset alone is fine
    with pytest.raises(ConfigError) as error:
        load_config(preset, overrides)
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 2  # one line, naming field and fix
    assert message in lines[1]


def test_the_docs_list_every_refused_combination() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    section = doc.split("## Refused combinations", 1)[1].split("\n## ", 1)[0]
    missing = [c for c, *_ in REFUSED if f"| {c} |" not in section]
    assert missing == []


def test_a_preset_writing_a_default_out_is_not_refused() -> None:
    # the pvpo preset writes pvpo.teacher = "oracle" (the default) out; its static-V ablation
    # has no group sampling, and that value means nothing there, but it is no user's choice
    cfg = load_config("pvpo", ["filter.kind=none"])
    assert cfg.pvpo.teacher == "oracle" and cfg.filter.kind == "none"
