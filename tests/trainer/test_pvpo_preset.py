"""The `pvpo` preset (the single-run options together) against `pvpo_paper` (the paper's
setting, the `pvpo` preset before them): what each sets, the way back from the new one's
refusals, one CLI step, and a store filled by the old preset read by the new one."""

from __future__ import annotations

import json

import pytest
from helpers import count_sampled
from typer.testing import CliRunner

from anchor_rl.cli import app
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.presets import read_preset
from anchor_rl.trainer.run import start_run

CHEAP = {"presample": "lazy", "reuse_presample": True, "m_min": 4, "anchor_update": "pooled"}
"""The `pvpo` preset's single-run options (docs/pvpo.md, "Cheaper in one run")."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))


def test_pvpo_is_paper_plus_the_single_run_options() -> None:
    new, paper = read_preset("pvpo"), read_preset("pvpo_paper")
    assert new.pop("rollout") == {"n": 2}  # N <= pvpo.m_min: reuse takes the first round
    assert {k: new["pvpo"].pop(k) for k in CHEAP} == CHEAP
    assert {**new, "preset": "pvpo_paper"} == paper  # the rest is the paper's preset
    cfg, old = load_config("pvpo"), load_config("pvpo_paper")
    assert (cfg.rollout.n, cfg.pvpo.m, old.rollout.n, old.pvpo.m) == (2, 8, 8, 8)
    assert (old.pvpo.presample, old.pvpo.reuse_presample) == ("upfront", False)
    assert (old.pvpo.m_min, old.pvpo.anchor_update) == (None, "none")


def test_a_refresh_with_the_pvpo_preset_names_the_way_back() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config("pvpo", ["pvpo.refresh_every=50"])
    message = str(refused.value)
    assert "--preset pvpo_paper" in message
    assert "pvpo.presample=upfront pvpo.reuse_presample=false" in message
    for way_back in (
        ("pvpo_paper", ["pvpo.refresh_every=50"]),
        ("pvpo", ["pvpo.refresh_every=50", "pvpo.presample=upfront", "pvpo.reuse_presample=false"]),
    ):
        assert load_config(*way_back).pvpo.refresh_every == 50
    with pytest.raises(ConfigError, match=r"pvpo.m_min=4 is above pvpo.m=2; .*pvpo.m_min=none"):
        load_config("pvpo", ["pvpo.m=2"])
    assert load_config("pvpo", ["pvpo.m=2", "pvpo.m_min=none"]).pvpo.m_min is None
    with pytest.raises(ConfigError, match=r"pvpo.m_min=4 must be at least that \(set pvpo.m_min=8"):
        load_config("pvpo", ["rollout.n=8"])


def test_m_min_none_in_a_toml_table_is_m_at_once() -> None:
    from anchor_rl.methods.pvpo_config import PVPOConfig

    assert PVPOConfig(m_min="none").m_min is None  # a suite pins M at once so
    assert PVPOConfig(m_min=4).m_min == 4


@pytest.mark.slow
def test_pvpo_preset_trains_one_step_on_arithmetic_from_the_cli(tmp_path) -> None:
    out = tmp_path / "cli"
    args = [
        "train", "--preset", "pvpo", "model=random:tiny", "train_prompts=4", "steps=1",
        "rollout.prompts_per_step=2", "rollout.max_new_tokens=8", "eval.prompts=2",
        "eval.every=1", "log.progress=false", "--out", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    step = read_metrics(out)[1]
    # a random init never solves arithmetic: each drawn prompt is settled (never solved) at
    # m_min = 4 rollouts and trained with the oracle's trace; its first group of N = 2 is two
    # of those rollouts, so the step samples no policy rollout
    assert step["rollouts/presample"] == 2 * 4
    assert step["rollouts/cumulative"] == 0
    assert step["rollouts/total"] == 2 * 4
    assert step["pvpo/reused_rows"] > 0 and step["pvpo/teacher_rows"] == 2
    stored = json.loads((out / "config.json").read_text())["pvpo"]
    assert stored | CHEAP == stored


@pytest.mark.slow
def test_the_pvpo_preset_reads_a_store_the_old_preset_filled(parity, tiny, tmp_path, monkeypatch):
    """Rows of the old preset (M = 8 at once, no rollouts kept): the new preset's sequential
    presampling reads all 8 draws and samples nothing; reuse finds no kept rollouts and
    samples the first groups fresh."""
    common = [*tiny, f"pvpo.store={tmp_path / 'anchors.db'}", "steps=2", "eval.every=0"]
    old = start_run(load_config("pvpo_paper", common), tmp_path / "old").components["pvpo"]
    assert {s.n for s in old.anchors.values()} == {8}
    calls = count_sampled(monkeypatch)
    run = train(start_run(load_config("pvpo", common), tmp_path / "new"))
    assert calls == []  # every drawn prompt's row was there, with n = 8 >= pvpo.m
    pvpo = run.components["pvpo"]
    assert pvpo.anchors and {s.n for s in pvpo.anchors.values()} == {8}
    assert pvpo.anchor_key == old.anchor_key
    metrics = read_metrics(run.run_dir)
    assert [m["pvpo/reused_rows"] for m in metrics] == [0.0, 0.0]
    n, prompts = run.cfg.rollout.n, run.cfg.rollout.prompts_per_step
    assert metrics[-1]["rollouts/cumulative"] == 2 * prompts * n  # all sampled fresh
