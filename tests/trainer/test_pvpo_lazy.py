"""PVPO's lazy presampling (pvpo.presample=lazy): only the prompts a run draws, resumable."""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import count_sampled

from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.store import AnchorStat, AnchorStore
from anchor_rl.methods.pvpo import (
    PooledAnchors,
    anchor_se,
    default_se_max,
    leave_one_out_anchor,
    presample_rounds,
    settled,
    walk_order,
)
from anchor_rl.tasks.base import Record
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train, train_step
from anchor_rl.trainer.run import resume_run, start_run

WORKER = Path(__file__).with_name("lazy_kill_worker.py")
PAPER = "pvpo_paper"
"""The preset the options are tested on one by one: the paper's (upfront, M at once, none
of the options); the `pvpo` preset's combination is tested in test_pvpo_preset.py."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))


def lazy_overrides(tiny: list[str], store: Path, *extra: str) -> list[str]:
    """A lazy PVPO run of the parity task: M = 2, the oracle teacher (accuracy-0 prompts
    kept), 2 prompts a step."""
    return [
        *tiny, "pvpo.m=2", f"pvpo.store={store}", "pvpo.presample=lazy",
        "checkpoint.every=1", "eval.every=1", *extra,
    ]  # fmt: skip


def _values(run) -> list[dict]:
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and "seconds" not in k}
        for r in read_metrics(run.run_dir)
    ]


def _rows(path: Path, key: str) -> dict[str, int]:
    with AnchorStore(path) as store:
        return {pid: stat.n for pid, stat in store.get_anchors(key).items()}


def test_a_lazy_run_presamples_only_the_prompts_it_draws(parity, tiny, tmp_path, monkeypatch):
    calls = count_sampled(monkeypatch)
    cfg = load_config(PAPER, lazy_overrides(tiny, tmp_path / "a.db", "steps=2"))
    run = start_run(cfg, tmp_path / "run")
    assert calls == []  # nothing before the first step
    pvpo = run.components["pvpo"]
    train(run)
    walk = pvpo.lazy
    order = [r.id for r in walk_order(parity.records("train"), 0)]
    walked = order[: walk.walked]
    dropped = [p for p in walked if walk.stats[p].all_correct]
    # 2 steps x 2 prompts, each drawn once: the pool is the first 4 walked prompts that
    # group sampling keeps (the oracle rescues accuracy 0), no more
    assert [r.id for r in walk.kept] == [p for p in walked if p not in dropped]
    assert len(walk.kept) == 4 and walk.walked == 4 + len(dropped) < len(order)
    assert sorted(p for call in calls for p in call) == sorted(walked)  # each sampled once
    assert _rows(tmp_path / "a.db", walk.key.digest) == dict.fromkeys(walked, 2)
    records = read_metrics(run.run_dir)
    assert records[0]["rollouts/presample"] == 0  # the step-0 evaluation: nothing yet
    assert records[-1]["rollouts/presample"] == 2 * len(walked) == pvpo.presample_rollouts
    assert records[1]["rollouts/presample"] < records[2]["rollouts/presample"]  # as drawn
    summary = json.loads((run.run_dir / "pvpo.json").read_text())
    assert summary["presample"]["rollouts_sampled_now"] == 2 * len(walked)
    assert summary["walk_target"] == 4


REUSE = ("pvpo.reuse_presample=true", "pvpo.m=4", "rollout.n=2")
"""A lazy run whose prompts' first groups are presampled rollouts (M = 4, n = 2)."""


POOLED = ("pvpo.anchor_update=pooled",)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [
        (),
        REUSE,
        (*REUSE, *POOLED),
        ("pvpo.presample=upfront", *POOLED),
        ("pvpo.m=4", "pvpo.m_min=2", "pvpo.round_size=1", "pvpo.se_max=0.3"),
    ],
    ids=["lazy", "reuse", "reuse+pooled", "upfront+pooled", "sequential"],
)
def test_a_resumed_lazy_run_equals_an_unstopped_one(extra, parity, tiny, tmp_path, monkeypatch):
    """A pool of 3 prompts (a resumed run keeps its walk target), so step 2 draws its last
    prompt and the first of a second epoch."""

    def config(store: str, steps: int):
        more = (f"steps={steps}", "pvpo.prompts=3", *extra)
        return load_config(PAPER, lazy_overrides(tiny, tmp_path / store, *more))

    straight = train(start_run(config("a.db", 3), tmp_path / "straight"))
    half = train(start_run(config("b.db", 1), tmp_path / "half"))
    calls = count_sampled(monkeypatch)
    resumed = resume_run(half.run_dir, {"steps": 3})
    assert calls == []  # the walk to the cursor re-reads the store
    train(resumed)
    assert _values(straight) == _values(resumed)
    key = straight.components["pvpo"].anchor_key
    assert _rows(tmp_path / "a.db", key) == _rows(tmp_path / "b.db", key)
    if not any(x.startswith("pvpo.m_min") for x in extra):  # rounds sample a prompt again
        assert len({p for call in calls for p in call}) == sum(len(c) for c in calls)


def test_lazy_presampling_refuses_a_refresh_and_v05(parity, tiny, tmp_path) -> None:
    with pytest.raises(ConfigError, match="pvpo.presample=lazy with pvpo.refresh_every"):
        load_config(PAPER, lazy_overrides(tiny, tmp_path / "a.db", "pvpo.refresh_every=2"))
    with pytest.raises(ConfigError, match="pvpo.presample has no effect"):  # V0.5 alone
        load_config("v05", lazy_overrides(tiny, tmp_path / "a.db", "v05.prior=anchor"))
    cfg = load_config("v05", lazy_overrides(tiny, tmp_path / "a.db", "filter.kind=group"))
    with pytest.raises(ConfigError, match="lazy with V0.5"):  # V0.5 with group sampling
        start_run(cfg, tmp_path / "run")


SEQUENTIAL = ("pvpo.m_min=2", "pvpo.round_size=1", "pvpo.se_max=0.3")
"""Sequential presampling with M = 4: 2 rollouts, then 1 a round until settled."""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "m"),
    [((), 2), (REUSE, 4), ((*REUSE, *POOLED), 4), ((*REUSE, *POOLED, *SEQUENTIAL), 4)],
    ids=["lazy", "reuse", "reuse+pooled", "reuse+pooled+sequential"],
)
def test_kill_9_mid_run_then_resume_samples_no_prompt_twice(extra, m, parity, tiny, tmp_path):
    """A real SIGKILL after step 2's prompts were presampled and stored, before its
    checkpoint: the resumed run finds them, and ends like an unstopped run."""
    store, run_dir = tmp_path / "k.db", tmp_path / "killed"
    overrides = lazy_overrides(tiny, store, "steps=3", *extra)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    job = subprocess.run(
        [sys.executable, str(WORKER), str(run_dir), json.dumps(overrides)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert job.returncode == -signal.SIGKILL, job.stderr[-2000:]
    killed = json.loads((run_dir / "walk.json").read_text())
    assert killed["checkpoint"] == 1 and killed["walked"] > 2  # step 2's prompts are stored
    resumed = resume_run(run_dir)
    walk = resumed.components["pvpo"].lazy
    assert walk.sampled_now == 0  # step 1's prompts re-read
    train(resumed)
    rounds = SEQUENTIAL[0] in extra  # a prompt's rollouts vary with its rounds: 2 to M
    if not rounds:
        assert walk.sampled_now == m * (walk.walked - killed["walked"])  # only those never stored
    again = lazy_overrides(tiny, tmp_path / "s.db", "steps=3", *extra)
    straight = train(start_run(load_config(PAPER, again), tmp_path / "straight"))
    rows = _rows(store, walk.key.digest)
    assert rows == _rows(tmp_path / "s.db", walk.key.digest)
    assert max(rows.values()) <= m and (rounds or set(rows.values()) == {m})  # none merged twice
    with AnchorStore(store) as kept:  # the rollouts themselves, kept with reuse only
        assert kept.rollout_count(walk.key.digest) == (sum(rows.values()) if extra else 0)
    # but pvpo/anchors_sampled: the resumed run reads, not samples, what the killed one stored
    keep = [{k: v for k, v in r.items() if k != "pvpo/anchors_sampled"} for r in _values(resumed)]
    assert [{k: v for k, v in r.items() if k != "pvpo/anchors_sampled"}
            for r in _values(straight)] == keep  # fmt: skip


def test_reused_first_groups_are_the_presampled_rollouts(parity, tiny, tmp_path, monkeypatch):
    """Every draw of a 2-step run is a first draw: no policy rollout is sampled, each row is a
    kept presampled one (a teacher row replaces the last of its group), weighted by truncated
    importance weights, against a leave-one-out anchor."""
    cfg = load_config(PAPER, lazy_overrides(tiny, tmp_path / "a.db", "steps=2", *REUSE))
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    fresh: list[int] = []
    inner = pvpo.reusing.engine
    real_rollout = inner.rollout

    def counting(requests, *args, **kwargs):
        fresh.append(len(requests))
        return real_rollout(requests, *args, **kwargs)

    monkeypatch.setattr(inner, "rollout", counting)
    seen = []
    real_inputs = pvpo.advantage_inputs

    def spy(step):
        out = real_inputs(step)
        seen.append((step.scored, pvpo._reused.clone(), out["anchor"]))
        return out

    monkeypatch.setattr(pvpo, "advantage_inputs", spy)
    train(run)
    records = read_metrics(run.run_dir)
    steps = [r for r in records if r["step"] > 0]
    assert fresh == [3, 3, 3]  # the evaluations only (eval.prompts = 3)
    assert all(r["rollouts/step"] == 0 and r["pvpo/reused_rows"] == 4 for r in steps)
    assert records[-1]["rollouts/total"] == records[-1]["rollouts/presample"]
    assert records[-1]["rollouts/presample"] == 4 * pvpo.lazy.walked
    assert [r["pvpo/reuse_staleness"] for r in steps] == [0.0, 1.0]
    assert all("pvpo/reuse_tis_weight_mean" in r for r in steps)
    for scored, reused, anchor in seen:
        for g, record in enumerate(scored.records):
            kept, _ = pvpo.lazy.store.get_rollouts(pvpo.lazy.key, record.id, 2)
            rows = (scored.batch.group == g).nonzero().flatten().tolist()
            stat = pvpo.anchors[record.id]
            for j, r in enumerate(rows):
                if bool(reused[r]):  # presampled rollout j; (sum of the 4 rewards - own) / 3
                    assert scored.batch.texts[r] == kept.texts[j]
                    want = (stat.reward_sum - scored.task_rewards[r].item()) / 3
                    assert anchor[r].item() == pytest.approx(want)
                else:  # a teacher row: the full mean
                    assert bool(scored.off_policy[r])
                    assert anchor[r].item() == pytest.approx(stat.mean)
    assert any(bool(reused.any()) for _, reused, _ in seen)


def test_the_leave_one_out_anchor_removes_the_shrink_of_the_full_mean() -> None:
    """Exact over every outcome of M Bernoulli(p) rewards: with the full mean as baseline, the
    advantage's covariance with a row's own reward (what its expected gradient scales with)
    is (1 - 1/M) p (1 - p); with the leave-one-out anchor it is p (1 - p)."""
    m, p = 4, 0.3
    full = loo = 0.0
    for outcome in itertools.product([0.0, 1.0], repeat=m):
        weight = math.prod(p if r else 1 - p for r in outcome)
        r0, total = outcome[0], sum(outcome)
        stat = AnchorStat("q", m, int(total), total, total, 0.0, 0.0)
        own = leave_one_out_anchor(stat, torch.tensor([r0]))[0].item()
        full += weight * (r0 - stat.mean) * (r0 - p)
        loo += weight * (r0 - own) * (r0 - p)
    assert full == pytest.approx((1 - 1 / m) * p * (1 - p))
    assert loo == pytest.approx(p * (1 - p))


def test_reuse_with_correction_none_divides_by_the_reference_logprobs(parity, tiny, tmp_path):
    extra = (*REUSE, "pvpo.reuse_correction=none", "pvpo.teacher=none", "pvpo.keep_unsolved=true")
    cfg = load_config(PAPER, lazy_overrides(tiny, tmp_path / "a.db", "steps=1", *extra))
    run = start_run(cfg, tmp_path / "r")
    pvpo = run.components["pvpo"]
    seen = {}
    real = pvpo.on_rollouts

    def spy(step):
        real(step)
        seen["scored"] = step.scored

    pvpo.on_rollouts = spy
    metrics = train_step(run)
    assert bool(seen["scored"].off_policy.all())  # every row: ratio against pi_reference
    assert "pvpo/reuse_tis_weight_mean" not in metrics
    with pytest.raises(ConfigError, match="needs pvpo.presample=lazy"):
        load_config(PAPER, [*tiny, *REUSE])
    with pytest.raises(ConfigError, match="rollout.n <= pvpo.m"):
        load_config(PAPER, [*tiny, "pvpo.presample=lazy", "pvpo.reuse_presample=true", "pvpo.m=2"])


def test_pooled_anchors_by_hand() -> None:
    """Prompt a: 2 presampled rewards summing to 1, an earlier draw's 4 policy rewards
    summing to 3; this group: 3 policy rows (1, 0, 1) and a teacher row (1)."""
    pooled = PooledAnchors({"a": (4, 3.0)})
    stats = {
        "a": AnchorStat("a", 2, 1, 1.0, 1.0, 0.0, 0.0),
        "b": AnchorStat("b", 4, 0, 2.0, 2.0, 0.0, 0.0),
    }
    group = torch.tensor([0, 0, 0, 0, 1, 1])
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 0.0])
    fresh = torch.tensor([True, True, True, False, False, False])
    reused = torch.tensor([False, False, False, False, True, True])  # b: presampled rows
    out = pooled.baselines(stats, ["a", "b"], group, rewards, fresh, reused)
    # a: pool 2 + 4 + 3 rows, sum 1 + 3 + 2 = 6; b: its 4 presampled rewards, sum 2
    want = [(6 - 1) / 8, (6 - 0) / 8, (6 - 1) / 8, 6 / 9, (2 - 1) / 3, (2 - 0) / 3]
    assert out.tolist() == pytest.approx(want)
    pooled.add(["a", "b"], group, rewards, fresh)
    assert pooled.sums == {"a": (7, 5.0), "b": (0, 0.0)}
    restored = PooledAnchors()
    restored.load_state_dict(pooled.state_dict())
    assert restored.sums == pooled.sums


def test_pooled_anchors_pool_a_prompts_later_draws(parity, tiny, tmp_path, monkeypatch) -> None:
    """A pool of 2 prompts over 3 steps of 2: from step 2 on every draw is a later draw, and
    its baseline pools the earlier draws' rewards."""
    more = ("steps=3", "pvpo.prompts=2", "pvpo.teacher=none", "pvpo.keep_unsolved=true")
    cfg = load_config(PAPER, lazy_overrides(tiny, tmp_path / "a.db", *more, *POOLED))
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    seen = []
    real_inputs = pvpo.advantage_inputs

    def spy(step):
        before = dict(pvpo.pooled.sums)
        out = real_inputs(step)
        seen.append((before, step.scored, out["anchor"]))
        return out

    monkeypatch.setattr(pvpo, "advantage_inputs", spy)
    train(run)
    assert [sum(n for n, _ in before.values()) for before, _, _ in seen] == [0, 8, 16]
    for before, scored, anchor in seen:
        for g, record in enumerate(scored.records):
            stat, (n, total) = pvpo.anchors[record.id], before.get(record.id, (0, 0.0))
            rows = (scored.batch.group == g).nonzero().flatten()
            r = scored.task_rewards[rows].double()
            pool_n, pool_sum = stat.n + n + len(rows), stat.reward_sum + total + r.sum().item()
            want = (pool_sum - r) / (pool_n - 1)
            assert anchor[rows].tolist() == pytest.approx(want.tolist())


def test_sequential_presampling_stops_each_prompt_when_settled(tmp_path) -> None:
    """M = 8, m_min = 4, rounds of 2, se_max = 0.2. Rollout j of prompt qi is correct iff
    PATTERNS[i][j]."""
    patterns = {
        "q0": [1] * 8,  # all correct at 4: settled (always solved as far as 4 tell)
        "q1": [0, 0, 0, 0, 1, 1, 1, 1],  # all wrong at 4: settled at 4 (never)
        "q2": [1, 0, 1, 0, 1, 0, 1, 0],  # SE at 4: sqrt(1/3 / 4) = 0.29; at 6: 0.22; 8: M
        "q3": [1, 0, 0, 0, 0, 0, 0, 0],  # SE at 4: 0.25; at 6: sqrt(1/6 / 6) = 0.167 <= 0.2
    }
    calls = []

    def sampler(records, n, first, seed):
        calls.append({r.id: (f, n) for r, f in zip(records, first, strict=True)})
        correct = torch.tensor(
            [[patterns[r.id][f + j] for j in range(n)] for r, f in zip(records, first, strict=True)]
        ).bool()
        return correct.double(), correct

    records = [Record(pid, pid, "") for pid in patterns]
    key = AnchorKey(model="m", tokenizer="t")
    pc = load_config(PAPER, ["pvpo.m_min=4", "pvpo.se_max=0.2"]).pvpo
    with AnchorStore(tmp_path / "a.db") as store:
        result = presample_rounds(records, sampler, store, key, pc, seed=0)
        counts = {pid: s.n for pid, s in store.get_anchors(key).items()}
        assert counts == {"q0": 4, "q1": 4, "q2": 8, "q3": 6}
        assert result.rollouts == sum(counts.values())
        assert calls[0] == dict.fromkeys(patterns, (0, 4))  # round 1: m_min each
        assert calls[1:] == [{"q2": (4, 2), "q3": (4, 2)}, {"q2": (6, 2)}]
        assert presample_rounds(records, sampler, store, key, pc, seed=0).rollouts == 0
        full = load_config(PAPER, []).pvpo  # a later run asking for M = 8 at once tops up
        assert presample_rounds(records, sampler, store, key, full, seed=0).rollouts == 4 + 4 + 2
        assert {s.n for s in store.get_anchors(key).values()} == {8}
        assert store.get_anchors(key)["q1"].n_correct == 4  # its later draws are stored


def test_anchor_se_and_the_default_target_by_hand() -> None:
    stat = AnchorStat("q", 4, 1, 1.0, 1.0, 0.0, 0.0)  # rewards 1, 0, 0, 0: s^2 = 1/4
    assert anchor_se(stat) == pytest.approx(math.sqrt(0.25 / 4))
    assert default_se_max(8) == pytest.approx(math.sqrt(0.25 / 8))
    assert settled(stat, m=8, m_min=4, se_max=0.25) and not settled(stat, 8, 4, 0.24)
    assert not settled(stat, m=8, m_min=5, se_max=1.0) and settled(stat, 4, 8, 0.0)
    with pytest.raises(ConfigError, match="pvpo.round_size has no effect"):
        load_config(PAPER, ["pvpo.round_size=3"])
    with pytest.raises(ConfigError, match="pvpo.m_min=9 is above pvpo.m=8"):
        load_config(PAPER, ["pvpo.m_min=9"])


def test_the_trl_and_verl_hosts_refuse_the_native_only_knobs() -> None:
    from anchor_rl.integrations.trl.pvpo import _check_pvpo
    from anchor_rl.integrations.verl.config import MethodConfig

    pc = load_config(PAPER, ["pvpo.presample=lazy", "pvpo.anchor_update=pooled"]).pvpo
    with pytest.raises(ConfigError, match="pvpo.presample, pvpo.anchor_update: built in anchor"):
        _check_pvpo(pc, True, "first_use")
    _check_pvpo(load_config(PAPER, []).pvpo, True, "first_use")  # the defaults pass
    with pytest.raises(ValueError, match="pvpo.m_min: built in anchor-rl train only"):
        MethodConfig.from_verl({"anchor_rl": {"method": "pvpo", "pvpo": {"m_min": 4}}})
