"""Torch threads per phase (anchor_rl.threads): who decides, what ``auto`` picks by size, how
the phases switch and restore, and what a run records."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from anchor_rl import threads
from anchor_rl.cli import app
from anchor_rl.threads import ONE_THREAD_BELOW, choose_threads, parse_setting
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

TINY_PARAMS, SMALL_PARAMS, BASE_PARAMS = 1_100_000, 10_500_000, 50_400_000
NO_ENV: dict[str, str] = {}


@pytest.fixture(autouse=True)
def unconfigured(monkeypatch):
    """Each test starts in a process that has not opted in (a run configures it)."""
    monkeypatch.setattr(threads, "_setting", None)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("params", [TINY_PARAMS, SMALL_PARAMS])
def test_auto_gives_small_models_one_thread_in_every_phase(params) -> None:
    choice = choose_threads(params, "auto", cores=8, environ=NO_ENV)
    assert (choice.generate, choice.update, choice.sft) == (1, 1, 1)
    assert choice.source == "auto"
    assert choice.line() == (
        f"threads: 1 ({threads.size_name(params)}; set threads=N or OMP_NUM_THREADS to override)"
    )


def test_auto_gives_larger_models_the_cores() -> None:
    choice = choose_threads(BASE_PARAMS, "auto", cores=4, environ=NO_ENV)
    assert (choice.generate, choice.update, choice.sft) == (4, 4, 4)
    assert choose_threads(BASE_PARAMS, "auto", cores=1, environ=NO_ENV).update == 1


def test_each_phase_has_its_own_size(monkeypatch) -> None:
    monkeypatch.setitem(ONE_THREAD_BELOW, "update", 1_000_000)
    choice = choose_threads(TINY_PARAMS, "auto", cores=2, environ=NO_ENV)
    assert (choice.generate, choice.update, choice.sft) == (1, 2, 1)
    assert choice.line().startswith("threads: generate 1, update 2 (tiny model")


def test_an_unknown_size_gets_the_cores() -> None:
    assert choose_threads(None, "auto", cores=3, environ=NO_ENV).generate == 3


def test_omp_num_threads_wins_over_auto() -> None:
    choice = choose_threads(BASE_PARAMS, "auto", cores=4, environ={"OMP_NUM_THREADS": "1"})
    assert (choice.generate, choice.update, choice.sft, choice.source) == (
        1, 1, 1, "OMP_NUM_THREADS",
    )  # fmt: skip
    choice = choose_threads(TINY_PARAMS, "auto", cores=4, environ={"OMP_NUM_THREADS": "3"})
    assert choice.update == 3
    assert choice.line() == "threads: 3 (OMP_NUM_THREADS=3)"
    # not a count: ignored
    assert choose_threads(BASE_PARAMS, "auto", 4, {"OMP_NUM_THREADS": "x"}).update == 4


def test_the_setting_wins_over_omp_num_threads() -> None:
    choice = choose_threads(TINY_PARAMS, 2, cores=4, environ={"OMP_NUM_THREADS": "1"})
    assert (choice.generate, choice.update, choice.sft, choice.source) == (2, 2, 2, "setting")
    assert choose_threads(TINY_PARAMS, "3", cores=4, environ=NO_ENV).sft == 3


@pytest.mark.parametrize("bad", [0, -1, "two", 1.5, True, ""])
def test_a_bad_setting_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="threads must be auto or a whole number"):
        parse_setting(bad)


def test_the_config_field_validates() -> None:
    assert load_config("grpo", ["threads=2"]).threads == 2
    assert load_config("grpo", []).threads == "auto"
    with pytest.raises(ConfigError, match="threads must be auto"):
        load_config("grpo", ["threads=0"])


def test_a_phase_changes_nothing_until_configured(tiny_model) -> None:
    torch.set_num_threads(1)
    with threads.phase("generate", tiny_model) as chosen:
        assert chosen is None
        assert torch.get_num_threads() == 1


def test_a_phase_sets_its_threads_and_restores_them(tiny_model) -> None:
    torch.set_num_threads(1)
    threads.configure(2)
    with threads.phase("generate", tiny_model) as chosen:
        assert chosen is not None and chosen.generate == 2
        assert torch.get_num_threads() == 2
    assert torch.get_num_threads() == 1


def test_the_engine_samples_with_the_generation_threads(tiny_model, tokenizer, monkeypatch):
    from anchor_rl.rollout import SamplingParams, group_requests, make_engine

    seen = []
    monkeypatch.setattr(
        "anchor_rl.rollout.engine.run_agent",
        lambda *a, **k: seen.append(torch.get_num_threads()) or [],
    )
    monkeypatch.setattr("anchor_rl.rollout.engine.pack", lambda *a, **k: None)
    torch.set_num_threads(1)
    threads.configure(2)
    engine = make_engine("hf", tiny_model, tokenizer)
    engine.rollout(group_requests(["1+1="], [0], 1, 0, "t"), SamplingParams(max_new_tokens=2))
    assert seen == [2]
    assert torch.get_num_threads() == 1


def test_a_run_records_its_choice(parity, tiny, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setitem(ONE_THREAD_BELOW, "update", 1_000)  # tiny's update gets the cores
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    cfg = load_config("grpo", [*tiny, "steps=2", "log.progress=true", "log.tensorboard=false"])
    run = train(start_run(cfg, tmp_path / "run"))
    assert (run.threads.generate, run.threads.update) == (1, 2)
    assert json.loads((run.run_dir / "config.json").read_text())["threads"] == "auto"
    records = read_metrics(run.run_dir)
    assert [(r["threads/generate"], r["threads/update"]) for r in records] == [(1, 2)] * 3
    out = capsys.readouterr().out
    assert "threads: generate 1, update 2 (tiny model; set threads=N or OMP_NUM_THREADS" in out


def test_a_run_with_a_setting_records_it_and_resume_may_change_it(parity, tiny, tmp_path):
    cfg = load_config("grpo", [*tiny, "steps=2", "threads=1", "log.tensorboard=false"])
    run = train(start_run(cfg, tmp_path / "run"))
    assert json.loads((run.run_dir / "config.json").read_text())["threads"] == 1
    assert read_metrics(run.run_dir)[-1]["threads/update"] == 1
    resumed = resume_run(run.run_dir, {"steps": 3, "threads": "auto"})
    assert resumed.cfg.threads == "auto"
    resumed.close()


def test_commands_take_threads(tmp_path) -> None:
    result = CliRunner().invoke(app, ["sft", "--threads", "0", "--out", str(tmp_path / "m")])
    assert result.exit_code == 2
    assert "threads must be auto or a whole number" in result.output
