"""Suite `trl`: the config mapping to TRL's GRPOConfig, the pieces handed to TRL, the
figures, and (when TRL is installed) a 1-step run of both trainers."""

from __future__ import annotations

import json
import os
import sys

import pytest

from anchor_rl.bench.runner import BenchArgs
from anchor_rl.bench.trl_compare import RewardCounter
from anchor_rl.bench.trl_config import (
    INSTALL_HINT,
    checkpointing_argument,
    grpo_config_kwargs,
    require_trl,
)
from anchor_rl.bench.trl_report import ratios, run_figures, summarise
from anchor_rl.integrations.trl.data import stop_token_ids, task_dataset, task_reward_function
from anchor_rl.models.tokenizer import build_tokenizer, encode_prompt
from anchor_rl.tasks import get_task
from anchor_rl.trainer.config import ConfigError, load_config


def test_grpo_preset_maps_to_grpo_config_by_hand() -> None:
    cfg = load_config(
        "grpo",
        ["rollout.prompts_per_step=4", "rollout.n=4", "steps=5", "optim.lr=3e-5",
         "rollout.max_new_tokens=32", "seed=3", "rollout.top_p=0.9"],
    )  # fmt: skip
    kwargs = grpo_config_kwargs(cfg, "/tmp/x")
    expected = {
        "output_dir": "/tmp/x",
        "seed": 3,
        "max_steps": 5,
        "use_cpu": True,
        "num_generations": 4,
        "per_device_train_batch_size": 16,  # 4 prompts x 4 completions, one optimizer step
        "gradient_accumulation_steps": 1,
        "steps_per_generation": 1,
        "num_iterations": 1,
        "temperature": 1.0,
        "top_p": 0.9,
        "top_k": 0,
        "max_completion_length": 32,
        "shuffle_dataset": False,
        "scale_rewards": "group",
        "loss_type": "grpo",
        "epsilon": 0.2,
        "epsilon_high": 0.2,
        "delta": None,
        "mask_truncated_completions": False,
        "beta": 0.04,
        "use_bias_correction_kl": False,
        "learning_rate": 3e-5,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "optim": "adamw_torch_fused",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "weight_decay": 0.0,
        "max_grad_norm": 1.0,
        "bf16": False,
        "fp16": False,
        checkpointing_argument(): False,
    }
    assert {k: kwargs[k] for k in expected} == expected


def test_the_config_turns_checkpointing_off_by_its_current_name(tmp_path) -> None:
    """TRL defaults to activation checkpointing; the mapping turns it off without the
    deprecation warning the old name raises on transformers that renamed it."""
    import warnings

    trl = require_trl()
    kwargs = grpo_config_kwargs(load_config("grpo", []), str(tmp_path))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*checkpointing.*deprecated")
        args = trl.GRPOConfig(**kwargs)
    assert args.gradient_checkpointing is False
    assert getattr(args, "activation_checkpointing", False) is False


def test_epochs_mini_and_micro_batches_map_to_accumulation_and_iterations() -> None:
    cfg = load_config(
        "drgrpo",
        ["rollout.prompts_per_step=4", "rollout.n=4", "steps=3", "optim.epochs=2",
         "optim.mini_batches=2", "optim.micro_batch_size=4", "loss.clip_c=3.0"],
    )  # fmt: skip
    kwargs = grpo_config_kwargs(cfg, "o")
    # 16 responses -> 2 mini-batches of 8 -> micro-batches of 4 (accumulate 2).
    assert kwargs["per_device_train_batch_size"] == 4
    assert kwargs["gradient_accumulation_steps"] == 2
    assert kwargs["steps_per_generation"] == 4  # micro-batches per generation
    assert kwargs["num_iterations"] == 2
    assert kwargs["max_steps"] == 3 * 2 * 2  # optimizer steps
    assert kwargs["scale_rewards"] == "none" and kwargs["loss_type"] == "dr_grpo"
    assert kwargs["beta"] == 0.0 and kwargs["delta"] == 3.0


def test_settings_trl_cannot_express_fail_naming_the_knob() -> None:
    with pytest.raises(ConfigError, match="filter.kind='dynamic'.*overlong_cache"):
        grpo_config_kwargs(load_config("dapo"), "o")
    with pytest.raises(ConfigError, match="advantage.estimator='rloo'"):
        grpo_config_kwargs(load_config("rloo"), "o")
    with pytest.raises(ConfigError, match="mini_batches=3 must divide"):
        grpo_config_kwargs(load_config("grpo", ["optim.mini_batches=3"]), "o")
    with pytest.raises(ConfigError, match="micro_batch_size=5"):
        grpo_config_kwargs(load_config("grpo", ["optim.micro_batch_size=5"]), "o")
    with pytest.raises(ConfigError, match="warmup"):
        grpo_config_kwargs(load_config("grpo", ["optim.warmup_steps=2"]), "o")
    with pytest.raises(ConfigError, match="clip_c"):
        grpo_config_kwargs(load_config("grpo", ["loss.clip_c=1.1"]), "o")


def test_missing_trl_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "trl", None)  # makes `import trl` fail
    with pytest.raises(ImportError) as err:
        require_trl()
    assert INSTALL_HINT in str(err.value) and ".[compare]" in INSTALL_HINT


def test_stop_tokens_prompts_and_reward_match_the_engine() -> None:
    tok = build_tokenizer()
    assert stop_token_ids(tok, ["</answer>"]) == [tok.convert_tokens_to_ids("</answer>")]
    with pytest.raises(ConfigError, match="'ab' is 2 tokens"):
        stop_token_ids(tok, ["ab"])
    task = get_task("arithmetic")
    records = task.records("train")[:3]
    rows = task_dataset(task, tok, records)
    assert rows["prompt_id"] == [r.id for r in records]
    for row, record in zip(rows, records, strict=True):
        # TRL renders a conversational prompt with the chat template and generation prompt
        rendered = tok.apply_chat_template(row["prompt"], add_generation_prompt=True)
        assert rendered["input_ids"] == encode_prompt(tok, record.prompt, task.instruction)
    reward = RewardCounter(task_reward_function(task, records))
    completions = [f"<answer>{records[2].answer}</answer>", "<answer>-1</answer>"]
    scores = reward(
        prompts=["p", "p"],
        completions=completions,
        prompt_id=[records[2].id, records[0].id],
        completion_ids=[[1] * 5, [2] * 3],
    )
    assert scores == [1.0, 0.0] and reward.tokens == [8] and reward.completions == 2


def _result(seconds, tokens, rewards, rss, final=None):
    out = {
        "steps": [
            {"seconds": s, "tokens": t, "reward": r}
            for s, t, r in zip(seconds, tokens, rewards, strict=True)
        ],
        "memory": {"rss_before_mb": rss - 100.0, "rss_peak_mb": rss, "cuda_peak_mb": None},
    }
    if final is not None:
        out["eval"] = {"start": {"eval/accuracy": 0.25}, "final": {"eval/accuracy": final}}
    return out


def test_figures_and_ratios_by_hand() -> None:
    ours = _result([1.0, 3.0], [10.0, 30.0], [0.0, 0.5], 500.0, final=0.5)
    f = run_figures(ours)
    assert f["s_per_step"] == 2.0 and f["tokens_per_s"] == 10.0 and f["tokens_per_step"] == 20.0
    assert f["s_per_step_warm"] == 3.0  # the steps after the first
    assert "s_per_step_warm" not in run_figures(_result([1.0], [10.0], [0.0], 500.0))
    assert f["reward_last"] == 0.5 and f["rss_peak_mb"] == 500.0 and f["rss_before_mb"] == 400.0
    assert f["eval_start"] == 0.25 and f["eval_final"] == 0.5 and "cuda_peak_mb" not in f
    theirs = [
        _result([2.0, 2.0], [20.0, 20.0], [0.0, 0.0], 800.0, final=0.25),
        _result([4.0, 4.0], [20.0, 20.0], [0.0, 0.0], 1000.0, final=0.75),
    ]
    summary = summarise({"anchor-rl": [ours, ours], "trl": theirs})
    assert summary["trl"]["s_per_step"]["mean"] == 3.0
    assert summary["trl"]["s_per_step"]["values"] == [2.0, 4.0]
    assert summary["anchor-rl"]["s_per_step"]["half_width"] == 0.0
    r = ratios(summary)  # paired by seed
    assert r["s_per_step"]["values"] == [1.0, 2.0] and r["s_per_step"]["mean"] == 1.5
    assert r["s_per_step_warm"]["values"] == [2.0 / 3.0, 4.0 / 3.0]
    assert r["tokens_per_s"]["values"] == [1.0, 0.5]  # 10/10, 5/10
    assert r["rss_peak_mb"]["values"] == [1.6, 2.0]
    assert r["eval_final_diff"]["values"] == [-0.25, 0.25] and r["eval_final_diff"]["mean"] == 0.0
    # sample std 0.707, standard error 0.5, t(0.975, 1) = 12.706
    assert r["s_per_step"]["half_width"] == pytest.approx(12.7062 * 0.5, rel=1e-4)


def test_ratio_cells_give_the_paired_mean_and_the_median_of_the_seeds() -> None:
    from anchor_rl.bench.trl_report import ratio_cells

    r = {
        "s_per_step": {"mean": 2.02, "half_width": 0.52, "n": 3, "values": [2.26, 1.88, 1.91]},
        "eval_final_diff": {
            "mean": -0.02,
            "half_width": 0.02,
            "n": 3,
            "values": [-0.03, 0.01, -0.02],
        },
    }
    # the median is the middle seed, not the mean: two seeds below 2x keep it below 2x
    assert ratio_cells(r, "s_per_step") == ("2.02 ± 0.52x", "1.91x")
    assert ratio_cells(r, "s_per_step", times="×")[1] == "1.91×"
    assert ratio_cells(r, "eval_final") == ("-0.020 ± 0.020 (difference)", "-0.020")
    assert ratio_cells(r, "rss_before_mb") == ("", "")  # a figure without a pairing


@pytest.mark.slow
def test_one_step_of_both_trainers(tmp_path) -> None:
    import trl

    from anchor_rl.bench.trl_compare import run_trl_suite

    # with one of TRL's own options, which reaches TRL's runs only
    args = BenchArgs(tmp_path, seeds=[0], profile="quick", echo=lambda _: None,
                     overrides=["trl.cache_implementation=static"])  # fmt: skip
    result = run_trl_suite(args)
    payload = json.loads(result["summary_json"].read_text())
    assert payload["trl_version"] == trl.__version__
    assert payload["trl_options"] == {"cache_implementation": "static"}
    assert payload["runs"]["trl"][0]["trl_options"] == {"cache_implementation": "static"}
    assert "trl_options" not in payload["runs"]["anchor-rl"][0]
    assert "trl.cache_implementation=static" in payload["command"]
    for framework in ("anchor-rl", "trl"):
        (run,) = payload["runs"][framework]
        assert len(run["steps"]) == 1 and run["steps"][0]["tokens"] > 0
        assert run["process_s"] > run["wall_s"] > 0  # the process also imports and loads
        assert 0.0 <= run["eval"]["final"]["eval/accuracy"] <= 1.0
        assert run["memory"]["rss_peak_mb"] >= run["memory"]["rss_before_mb"] > 0
        # anchor-rl's run sets glibc's thresholds; TRL's process keeps the defaults
        assert run["allocator"] == {"kept": framework == "anchor-rl"}
    # Both evaluate the same initial model the same way.
    starts = [payload["runs"][f][0]["eval"]["start"] for f in ("anchor-rl", "trl")]
    assert starts[0] == starts[1]
    assert set(payload["ratios"]) >= {"s_per_step", "tokens_per_s", "rss_peak_mb"}
    text = result["summary_md"].read_text()
    assert "TRL / anchor-rl" in text and "What differs" in text
    assert result["plots"][0].is_file()
    # The mapping is accepted by this TRL version as is.
    trl.GRPOConfig(**payload["grpo_config"], output_dir=str(tmp_path / "cfg"))


def test_jax_is_kept_off_the_gpu_unless_the_environment_says(monkeypatch) -> None:
    from anchor_rl.bench.trl_compare import JAX_SETTINGS, keep_jax_off_the_gpu

    for name in JAX_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")  # the user's own choice stays
    keep_jax_off_the_gpu()
    assert os.environ["JAX_PLATFORMS"] == "cuda"
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_a_decoder_other_than_the_default_is_named_in_the_summary(tmp_path) -> None:
    from anchor_rl.bench.runner import plan
    from anchor_rl.bench.trl_compare import TRL_SUITE
    from anchor_rl.bench.trl_report import _decode_note, _settings

    (spec,) = plan(TRL_SUITE, tmp_path, seeds=[0], overrides=["rollout.engine_args.decode=graph"])
    assert _settings(spec.config)["anchor_rl_decode"] == "graph"
    (default,) = plan(TRL_SUITE, tmp_path, seeds=[0])
    assert _settings(default.config)["anchor_rl_decode"] == "auto"
    assert _decode_note("auto") == ""
    assert "`rollout.engine_args.decode=graph`" in _decode_note("graph")


def test_a_comparison_cut_short_is_summarised_over_the_seeds_both_trainers_finished(
    tmp_path,
) -> None:
    from anchor_rl.bench.runner import plan
    from anchor_rl.bench.trl_compare import TRL_SUITE
    from anchor_rl.bench.trl_report import rewrite_summary

    specs = plan(TRL_SUITE, tmp_path, seeds=[0, 1, 2])
    host = {"device": "cpu", "device_name": "test", "torch_threads": 1, "versions": {}}
    finished = {"anchor-rl": [0, 1, 2], "trl": [0, 1]}  # TRL's seed 2 was cut off
    for framework, seeds in finished.items():
        for spec in specs:
            if spec.seed not in seeds:
                continue
            slow = 2.0 if framework == "trl" else 1.0
            run = _result([slow * (spec.seed + 1)] * 2, [10.0, 10.0], [0.0, 0.0], 500.0, 0.5)
            run |= {"config": spec.config.model_dump(mode="json"), "host": host}
            run |= {"version": "1.0", "wall_s": 1.0, "framework": framework}
            folder = tmp_path / framework / f"seed{spec.seed}"
            folder.mkdir(parents=True)
            (folder / "result.json").write_text(json.dumps(run))
    with pytest.raises(ValueError, match="no seed that both trainers finished"):
        rewrite_summary(tmp_path / "anchor-rl", "cmd")
    note = "These runs predate a change."
    result = rewrite_summary(tmp_path, "anchor-rl bench trl --seeds 0,1,2", [0, 1, 2], note)
    payload = json.loads(result["summary_json"].read_text())
    assert payload["seeds"] == [0, 1] and payload["seeds_planned"] == [0, 1, 2]
    assert payload["unpaired"] == ["anchor-rl seed 2"]
    assert payload["ratios"]["s_per_step"]["values"] == [2.0, 2.0]
    assert payload["summary"]["anchor-rl"]["s_per_step"]["values"] == [1.0, 2.0]
    text = result["summary_md"].read_text()
    assert "**Partial**: 2 of the 3 planned seeds (0, 1, 2)" in text and note in text
    assert "left out for want of their pair: anchor-rl seed 2" in text
    assert "Command: `anchor-rl bench trl --seeds 0,1,2`" in text


def test_trl_options_are_split_from_the_overrides_and_best_adds_the_cpu_settings(
    monkeypatch,
) -> None:
    from anchor_rl.bench import trl_config
    from anchor_rl.bench.trl_config import split_trl_options

    given = ["model=sft:tiny", "trl.cache_implementation=static", "optim.lr=1e-5"]
    assert split_trl_options(given) == (
        ["model=sft:tiny", "optim.lr=1e-5"],
        {"cache_implementation": "static"},
    )
    assert split_trl_options(["trl.best=false"]) == ([], {})
    monkeypatch.setattr(
        trl_config, "BEST_CPU", {"cache_implementation": "static", "top_entropy_quantile": 1.0}
    )
    rest, options = split_trl_options(
        [
            "trl.best=true",
            "trl.cache_implementation=dynamic",
            "trl.generation_kwargs={use_cache=true}",
        ]
    )
    # best adds every CPU setting; a field named as well wins; TOML tables become dicts
    assert rest == [] and options == {
        "cache_implementation": "dynamic",
        "top_entropy_quantile": 1.0,
        "generation_kwargs": {"use_cache": True},
    }
    with pytest.raises(ConfigError, match="trl.best takes true or false"):
        split_trl_options(["trl.best=3"])
    with pytest.raises(ConfigError, match="trl.FIELD=VALUE"):
        split_trl_options(["trl.a.b=1"])


def test_trl_options_reach_grpo_config_beside_the_mapping(tmp_path) -> None:
    from anchor_rl.bench.trl_config import check_trl_options

    trl = require_trl()
    cfg = load_config("grpo", ["optim.autocast=bf16", "rollout.engine_args.precision=bf16"])
    options = {
        "cache_implementation": "static",
        "use_transformers_continuous_batching": True,
        "transformers_continuous_batching_config": {"num_blocks": 80},
    }
    check_trl_options(trl, options)
    plain = grpo_config_kwargs(cfg, str(tmp_path))
    kwargs = grpo_config_kwargs(cfg, str(tmp_path), options)
    assert kwargs == plain | options  # the mapped fields stay as they are
    args = trl.GRPOConfig(**kwargs)
    assert args.cache_implementation == "static"
    assert args.use_transformers_continuous_batching is True
    assert args.transformers_continuous_batching_config == {"num_blocks": 80}
    assert args.bf16 is True and args.beta == cfg.kl.coef
    assert trl.GRPOConfig(**plain).cache_implementation is None
    # an option may not replace a mapped setting, nor name a field TRL does not have
    with pytest.raises(ConfigError, match="trl.beta: the comparison maps"):
        grpo_config_kwargs(cfg, "o", {"beta": 0.0})
    with pytest.raises(ConfigError, match="trl.no_such_field"):
        check_trl_options(trl, {"no_such_field": 1, "cache_implementation": "static"})


def test_the_summary_names_the_options_trl_ran_with(tmp_path) -> None:
    from anchor_rl.bench.runner import plan
    from anchor_rl.bench.trl_compare import TRL_SUITE
    from anchor_rl.bench.trl_report import rewrite_summary

    (spec,) = plan(TRL_SUITE, tmp_path, seeds=[0])
    host = {"device": "cpu", "device_name": "test", "torch_threads": 1, "versions": {}}
    options = {"cache_implementation": "static"}
    for framework in ("anchor-rl", "trl"):
        run = _result([1.0, 1.0], [10.0, 10.0], [0.0, 0.0], 500.0, 0.5)
        run |= {"config": spec.config.model_dump(mode="json"), "host": host, "version": "1.0"}
        run |= {"wall_s": 1.0, "framework": framework}
        if framework == "trl":
            run["trl_options"] = options
        folder = tmp_path / framework / "seed0"
        folder.mkdir(parents=True)
        (folder / "result.json").write_text(json.dumps(run))
    result = rewrite_summary(tmp_path, "anchor-rl bench trl trl.cache_implementation=static")
    payload = json.loads(result["summary_json"].read_text())
    assert payload["trl_options"] == options
    assert payload["grpo_config"]["cache_implementation"] == "static"
    assert payload["runs"]["trl"][0]["trl_options"] == options
    assert "TRL also ran with `cache_implementation='static'`" in result["summary_md"].read_text()
