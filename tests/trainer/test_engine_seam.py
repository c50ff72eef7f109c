"""The engine seam: a seeded run gives the same metrics through an engine in another process
(tests/trainer/subprocess_engine.py, fed weights through ``sync_weights``) as through the
built-in in-process engine; nothing outside anchor_rl.rollout builds a concrete engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import subprocess_engine
import torch
from helpers import metrics_but_timings

import anchor_rl
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "extra"),
    [
        ("grpo", []),
        ("v05", ["pvpo.m=2"]),  # top-ups go through the engine too
        ("pvpo_paper", ["pvpo.m=2", "pvpo.refresh_every=1", "pvpo.refresh_mode=policy"]),
    ],
)
def test_the_same_seeded_run_through_another_engine(
    preset, extra, parity, tiny, tmp_path, one_thread
) -> None:
    overrides = [*tiny, "steps=3", "optim.lr=1e-3", *extra]
    # each run its own anchor store, so each samples its anchors and refreshes itself
    store = (lambda name: [f"pvpo.store={tmp_path}/{name}.db"]) if extra else (lambda name: [])
    local = train(start_run(load_config(preset, [*overrides, *store("hf")]), tmp_path / "hf"))
    remote_cfg = [*overrides, *store("sub"), "rollout.engine=subprocess"]
    remote = start_run(load_config(preset, remote_cfg), tmp_path / "sub")
    assert isinstance(remote.engine, subprocess_engine.SubprocessEngine)
    remote = train(remote)
    assert metrics_but_timings(local.run_dir) == metrics_but_timings(remote.run_dir)
    assert any(r.get("grad_norm", 0) > 0 for r in read_metrics(local.run_dir))  # real updates
    assert remote.engine.syncs == 1 + 3  # the initial weights, then after every update
    assert not remote.engine.alive  # the run closed the engine it built when it ended
    for key, value in local.policy.state_dict().items():
        assert torch.equal(value, remote.policy.state_dict()[key]), key


def test_an_unknown_engine_names_the_registered_ones() -> None:
    with pytest.raises(ConfigError, match="unknown engine 'vllm'; registered: hf"):
        load_config("grpo", ["rollout.engine=vllm"])


def test_no_module_outside_rollout_builds_the_concrete_engine() -> None:
    root = Path(anchor_rl.__file__).parent
    users = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "HFEngine" in p.read_text() and p.parent.name != "rollout"
    ]
    assert users == []
