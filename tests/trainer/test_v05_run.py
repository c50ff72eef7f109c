"""V0.5 end to end on a random-init tiny model: the preset, prior updates, resume, the probe."""

from __future__ import annotations

import pytest
import torch
from test_v05 import V05_KEYS

from anchor_rl.anchors.priors import HistoryPrior
from anchor_rl.bench.v05_probe import read_probe
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, start_run

STEP_KEYS = {
    "reward/mean", "accuracy", "policy/entropy", "advantage/mean", "advantage/zero_frac",
    "rollouts/cumulative", "rollouts/presample", "loss/policy", "grad_norm",
}  # fmt: skip
PROBE = [
    "plugins=anchor_rl.bench.v05_probe", "components=v05_probe",
    "component_args.v05_probe.every=1", "component_args.v05_probe.prompts=3",
    "component_args.v05_probe.truth=4", "component_args.v05_probe.heldout=3",
    "component_args.v05_probe.heldout_truth=4",
]  # fmt: skip


@pytest.fixture
def v05_tiny(tiny, tmp_path) -> list[str]:
    """The tiny overrides plus an anchor store of the test's own."""
    return [*tiny, f"pvpo.store={tmp_path / 'anchors.db'}", "pvpo.m=4"]


def _training_values(run_dir) -> list[dict[str, float]]:
    return [
        {k: v for k, v in r.items() if not k.startswith(("time/", "probe/"))}
        for r in read_metrics(run_dir)
    ]


@pytest.mark.slow
def test_v05_preset_one_step_end_to_end(parity, v05_tiny, tmp_path) -> None:
    cfg = load_config("v05", [*v05_tiny, "steps=1", "eval.every=1"])
    run = train(start_run(cfg, tmp_path / "v05"))
    records = read_metrics(run.run_dir)
    assert [r["step"] for r in records] == [0, 1]
    step = records[1]
    assert set(step) >= STEP_KEYS | V05_KEYS | {"eval/accuracy"}
    # every rollout counts, top-ups included; the anchors cost 8 train prompts x M = 4
    assert step["rollouts/cumulative"] == 8 + step["v05/extra_rollouts"] == step["rollouts/step"]
    assert step["rollouts/presample"] == 32
    assert step["v05/rollouts_per_prompt"] == step["rollouts/step"] / 2
    # the prior (history over the anchor) learned the step's rewards
    prior = run.components["v05"].prior
    assert isinstance(prior, HistoryPrior) and prior.step == 1
    alpha, beta = prior.posterior([r.id for r in parity.records("train")])
    seen = (alpha + beta) > prior.strength + 1e-9
    assert 1 <= int(seen.sum()) <= 2  # the step's prompts (2, possibly one drawn twice)


@pytest.mark.slow
def test_resume_restores_the_prior_exactly(parity, v05_tiny, tmp_path) -> None:
    # pvpo.prompts fixed: the anchor prior's walk would otherwise stop at each run's draws
    overrides = [*v05_tiny, "optim.lr=1e-2", "checkpoint.every=2", "eval.every=0", "pvpo.prompts=4"]
    straight = train(start_run(load_config("v05", [*overrides, "steps=4"]), tmp_path / "a"))
    half = train(start_run(load_config("v05", [*overrides, "steps=2"]), tmp_path / "b"))
    resumed = train(resume_run(half.run_dir, {"steps": 4}))
    a, b = _training_values(straight.run_dir), _training_values(resumed.run_dir)
    assert [r["step"] for r in a] == [1, 2, 3, 4]
    assert a == b
    assert resumed.components["v05"].prior.step == 4


@pytest.mark.slow
def test_probe_measures_and_never_changes_training(parity, v05_tiny, tmp_path) -> None:
    base = [*v05_tiny, "steps=2", "eval.every=0"]
    plain = train(start_run(load_config("v05", base), tmp_path / "plain"))
    probed = train(start_run(load_config("v05", [*base, *PROBE]), tmp_path / "probed"))
    assert _training_values(plain.run_dir) == _training_values(probed.run_dir)
    probes = read_probe(probed.run_dir)
    assert [p["step"] for p in probes] == [1, 2]
    assert set(probes[0]["methods"]) == {
        "group_mean_k4", "loo_k4", "group_mean_k16", "anchor", "prior", "v05_k4", "v05_adaptive",
    }  # fmt: skip
    assert "knn_heldout" in probes[0] and "run_prior_heldout" not in probes[0]
    assert {"auc", "ece", "mse", "pred_mean", "true_mean"} <= set(probes[0]["prior_probe"])
    # 3 prompts x (16 + 4) + 3 held-out x 4, counted apart from training
    assert probes[0]["rollouts"] == 72
    metrics = read_metrics(probed.run_dir)
    assert metrics[1]["probe/rollouts_cumulative"] == 144
    assert (
        metrics[1]["rollouts/cumulative"]
        == metrics[0]["rollouts/cumulative"] + metrics[1]["rollouts/step"]
    )
    assert all(torch.isfinite(torch.tensor(m["mse"])) for m in probes[1]["methods"].values())


@pytest.mark.slow
def test_knn_prior_runs_on_the_policys_embeddings(parity, tiny, tmp_path) -> None:
    cfg = load_config("v05", [*tiny, "steps=2", "eval.every=0", "v05.prior=knn", *PROBE])
    run = train(start_run(cfg, tmp_path / "knn"))
    assert len(run.components["v05"].prior) == 4  # two steps of two prompts in its context
    probes = read_probe(run.run_dir)
    assert "anchor" not in probes[0]["methods"]  # a knn run has no anchors
    assert probes[1]["run_prior_heldout"]["n"] == 3
    assert not (run.run_dir / "pvpo.json").exists()  # nothing presampled
