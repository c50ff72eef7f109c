"""PVPO in the trainer: store anchors in the advantage, teacher rows, group sampling, refresh, resume."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.presample import RolloutSampler, refresh_key
from anchor_rl.anchors.store import AnchorStore, TeacherTrajectory
from anchor_rl.batch import RolloutBatch
from anchor_rl.cli import app
from anchor_rl.methods.pvpo import pool_target, presample_cost_note, walk_order
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import save_policy
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.rollout.spec import load_spec
from anchor_rl.tasks.base import Record
from anchor_rl.trainer import loop
from anchor_rl.trainer.advantage import base_inputs, compute_advantages
from anchor_rl.trainer.collect import Scored
from anchor_rl.trainer.config import ConfigError, load_config
from anchor_rl.trainer.data import PromptSampler
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train, train_step
from anchor_rl.trainer.pvpo import batch_anchors, inject_teachers, reference_key
from anchor_rl.trainer.run import resume_run, start_run
from anchor_rl.trainer.update import behaviour_logprobs, score_logprobs

IDS = [f"train-{i}" for i in range(8)]
PAPER = "pvpo_paper"
"""The preset of the tests of the paper's mechanisms (the whole walk presampled before the
first step, refreshes, the static anchor); the `pvpo` preset's single-run options are
tested in test_pvpo_lazy.py and test_pvpo_preset.py."""


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """Keep the shared anchor store (and any SFT) out of the user's cache."""
    monkeypatch.setenv("ANCHOR_RL_CACHE", str(tmp_path / "cache"))


def _batch(texts: list[str], group: list[int], width: int = 2) -> RolloutBatch:
    b = len(texts)
    return RolloutBatch(
        group=torch.tensor(group),
        prompt_ids=[[1, 2]] * b,
        response_ids=torch.full((b, width), 9),
        attention_mask=torch.ones(b, width),
        loss_mask=torch.ones(b, width),
        logprobs=torch.full((b, width), -1.0),
        texts=texts,
        tool_calls=torch.zeros(b, dtype=torch.long),
        truncated=torch.zeros(b, dtype=torch.bool),
    )


def test_pvpo_advantage_subtracts_the_store_anchors_by_hand(tmp_path) -> None:
    with AnchorStore(tmp_path / "a.db") as store:
        key = AnchorKey(model="m", tokenizer="t")
        # prompt a: rewards 1, 0, 0, 1 -> V = 0.5; prompt b: 1, 1, 1, 0 -> V = 0.75
        store.add_rollouts(
            key, ["a", "b"], [[1, 0, 0, 1], [1, 1, 1, 0]], [[1, 0, 0, 1], [1, 1, 1, 0]]
        )
        anchors = store.get_anchors(key)
    records = [Record("b", "q", "x"), Record("a", "q", "x")]  # group 0 is prompt b
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    scored = Scored(_batch(["", "", "", ""], [0, 0, 1, 1]), records, rewards, rewards, rewards > 0)
    anchor = batch_anchors(anchors, scored)
    assert anchor.tolist() == [0.75, 0.75, 0.5, 0.5]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
    cfg = load_config("pvpo")
    inputs = base_inputs(cfg, rewards, scored.batch.group, mask, torch.zeros(4, 2), None)
    adv = compute_advantages(cfg, inputs | {"anchor": anchor})
    # r - V, no std scaling: [0.25, -0.75, -0.5, 0.5] on every loss token
    expected = torch.tensor([[0.25, 0.25], [-0.75, 0.0], [-0.5, -0.5], [0.0, 0.5]])
    torch.testing.assert_close(adv, expected)


def test_behaviour_logprobs_keep_the_off_policy_rows() -> None:
    batch = _batch(["", "", ""], [0, 0, 0])
    recomputed = torch.tensor([[-0.1, -0.2], [-0.3, -0.4], [-0.5, -0.6]])
    out = behaviour_logprobs(recomputed, batch, torch.tensor([False, True, False]))
    torch.testing.assert_close(out, torch.tensor([[-0.1, -0.2], [-1.0, -1.0], [-0.5, -0.6]]))


def _trajectory(prompt_id: str, logprob: float = -0.5) -> TeacherTrajectory:
    return TeacherTrajectory(
        prompt_id=prompt_id,
        token_ids=torch.tensor([5, 6, 7]),
        logprobs=torch.tensor([logprob, 2 * logprob, 0.0]),
        loss_mask=torch.tensor([1.0, 1.0, 0.0]),
        text="0",
        reward=1.0,
        teacher="test",
    )


def test_inject_teachers_replaces_the_last_rollout_of_the_group_by_hand(parity) -> None:
    records = [Record("r0", "q0", "even"), Record("r1", "q1", "even")]
    batch = _batch(["1", "1", "1", "3"], [0, 0, 1, 1])
    rewards = torch.zeros(4)
    scored = Scored(batch, records, rewards, rewards, rewards > 0)
    out = inject_teachers(scored, {"r1": _trajectory("r1")}, parity, load_config("pvpo"))
    assert out.batch.texts == ["1", "1", "1", "0"]  # row 3 ("3") replaced, in place
    assert out.batch.group.tolist() == [0, 0, 1, 1]
    assert out.off_policy.tolist() == [False, False, False, True]
    assert out.rewards.tolist() == [0.0, 0.0, 0.0, 1.0]  # the verifier's reward of "0"
    assert out.correct.tolist() == [False, False, False, True]
    assert out.batch.response_ids[3].tolist() == [5, 6, 7]
    assert out.batch.response_ids[0].tolist() == [9, 9, 0]  # re-padded to T = 3
    assert out.batch.logprobs[3].tolist() == [-0.5, -1.0, 0.0]
    assert out.batch.loss_mask[3].tolist() == [1.0, 1.0, 0.0]
    assert out.batch.prompt_ids[3] == [1, 2]
    assert inject_teachers(scored, {}, parity, load_config("pvpo")) is scored


def _count_sampled(monkeypatch) -> list[int]:
    """From now on, the rollouts of each reference-sampler call, appended to the list returned."""
    calls: list[int] = []
    real_call = RolloutSampler.__call__

    def counting(self, records, n, first, seed):
        calls.append(len(records) * n)
        return real_call(self, records, n, first, seed)

    monkeypatch.setattr(RolloutSampler, "__call__", counting)
    return calls


def _overrides(tiny, tmp_path, *extra: str) -> list[str]:
    return [*tiny, "pvpo.m=2", f"pvpo.store={tmp_path / 'anchors.db'}", *extra]


@pytest.mark.slow
def test_teacher_row_old_logp_in_the_update_is_the_teachers(parity, tiny, tmp_path, monkeypatch):
    cfg = load_config(
        PAPER, _overrides(tiny, tmp_path, "pvpo.teacher=none", "pvpo.keep_unsolved=true")
    )
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    pvpo.trajectories = {r.id: _trajectory(r.id, -0.25) for r in pvpo.records}
    seen = {}
    on_rollouts = pvpo.on_rollouts

    def spy_step(step):
        on_rollouts(step)
        seen["scored"] = step.scored

    def spy_update(model, optimizer, scheduler, batch, mask, old_logp, *rest, **kwargs):
        seen["old_logp"], seen["logp"] = old_logp.clone(), score_logprobs(model, batch, cfg)[0]
        return real_update(model, optimizer, scheduler, batch, mask, old_logp, *rest, **kwargs)

    real_update = loop.ppo_update
    monkeypatch.setattr(pvpo, "on_rollouts", spy_step)
    monkeypatch.setattr(loop, "ppo_update", spy_update)
    metrics = train_step(run)
    rows = seen["scored"].off_policy.nonzero().flatten().tolist()
    assert metrics["pvpo/teacher_rows"] == len(rows) == cfg.rollout.prompts_per_step
    for r in rows:  # log pi_gt on the teacher's tokens, not the policy's recomputed log-probs
        assert seen["old_logp"][r, :3].tolist() == [-0.25, -0.5, 0.0]
    others = [r for r in range(len(seen["scored"])) if r not in rows]
    assert all(seen["old_logp"][r].abs().sum() > 0 for r in others)
    # mean log pi_gt per teacher token (the masked tool token excluded): (-0.25 - 0.5) / 2
    assert metrics["pvpo/teacher_behaviour_logp"] == pytest.approx(-0.375)
    # the policy's own mean log-prob on those tokens (5 and 6), before the update
    logp = seen["logp"][rows, :2]
    assert metrics["pvpo/teacher_logp"] == pytest.approx(logp.mean().item(), rel=1e-6)
    assert metrics["pvpo/teacher_logp"] < 0


def _seed_store(cfg, task, path, correct: list[list[int]]) -> None:
    reference, tokenizer = load_spec(cfg.model, cfg.task, cfg.task_args, cfg.seed, "cpu", False)
    with AnchorStore(path) as store:
        store.add_rollouts(reference_key(cfg, task, tokenizer, reference), IDS, correct, correct)


# reference accuracy per prompt: train-0, 1 solved; train-2, 3 mixed; train-4..7 never solved
CORRECT = [[1, 1], [1, 1], [1, 0], [0, 1], [0, 0], [0, 0], [0, 0], [0, 0]]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("filter_kind", "teacher", "training", "with_teacher"),
    [
        ("group", "none", IDS[2:4], []),
        ("group", "oracle", IDS[2:], IDS[4:]),  # the parity trace "0" is correct
        ("none", "oracle", IDS, []),  # static V only: every prompt, no teacher
    ],
)
def test_group_sampling_sets_the_training_prompts(
    filter_kind, teacher, training, with_teacher, parity, tiny, tmp_path
) -> None:
    cfg = load_config(
        PAPER, _overrides(tiny, tmp_path, f"filter.kind={filter_kind}", f"pvpo.teacher={teacher}")
    )
    _seed_store(cfg, parity, tmp_path / "anchors.db", CORRECT)
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    assert [r.id for r in run.sampler.records] == training
    assert sorted(pvpo.trajectories) == with_teacher
    assert {pid: s.mean for pid, s in pvpo.anchors.items()} == {
        pid: sum(c) / 2 for pid, c in zip(IDS, CORRECT, strict=True) if pid in training
    }
    summary = json.loads((run.run_dir / "pvpo.json").read_text())
    assert summary["presample"]["rollouts_sampled_now"] == 0  # all found in the store
    assert summary["presample"]["rollouts"] == pvpo.presample_rollouts == 16
    stats_file = run.run_dir / "pvpo_filter.json"
    assert stats_file.is_file() == (filter_kind == "group")
    if filter_kind == "group":
        counts = json.loads(stats_file.read_text())["counts"]
        assert (counts["dropped_solved"], counts["kept"], counts["acc_zero"]) == (2, 2, 4)
        assert counts["with_teacher"] == len(with_teacher)
    drawn = PromptSampler(run.sampler.records, cfg.seed).take(cfg.rollout.prompts_per_step)
    metrics = train_step(run)  # one teacher row per drawn prompt that has a trajectory
    assert metrics["pvpo/teacher_rows"] == sum(r.id in with_teacher for r in drawn)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["reference", "policy"])
def test_refresh_counts_its_rollouts_and_replaces_the_anchors(mode, parity, tiny, tmp_path):
    extra = ("pvpo.teacher=none", "pvpo.keep_unsolved=true", "pvpo.refresh_every=1", "steps=2")
    cfg = load_config(PAPER, _overrides(tiny, tmp_path, *extra, f"pvpo.refresh_mode={mode}"))
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    presampled = dict(pvpo.anchors)
    train(run)
    records = read_metrics(run.run_dir)
    n_train = len(pvpo.records)
    # refreshed once, before step 2 (after step 1): M = 2 rollouts per training prompt
    assert "pvpo/refresh_sampled" not in records[1]
    assert records[2]["pvpo/refresh_sampled"] == 2 * n_train
    assert records[2]["rollouts/refresh"] == pvpo.refresh_rollouts == 2 * n_train
    for r in records:
        assert r["rollouts/total"] == (
            r["rollouts/cumulative"] + r["rollouts/presample"] + r["rollouts/refresh"]
        )
    assert records[2]["rollouts/presample"] == 2 * 8
    assert pvpo.anchor_key != pvpo.set.key.digest
    if mode == "reference":
        assert pvpo.anchor_key == refresh_key(pvpo.set.key, "reference", 1).digest
    assert set(pvpo.anchors) == {r.id for r in pvpo.records}
    assert any(pvpo.anchors[p].mean != presampled[p].mean for p in pvpo.anchors)


@pytest.mark.slow
def test_resume_keeps_the_counters_and_does_not_presample_again(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    extra = [
        "pvpo.prompts=4",  # a walk of the 8 prompts; the resumed run walks to the same 4
        "pvpo.refresh_every=1",
        "pvpo.refresh_mode=policy",
        "checkpoint.every=1",
        "eval.every=1",
    ]

    def config(name: str, steps: int):
        return load_config(
            PAPER,
            [*tiny, "pvpo.m=2", f"pvpo.store={tmp_path / name}.db", *extra, f"steps={steps}"],
        )

    straight = train(start_run(config("a", 3), tmp_path / "straight"))
    half = train(start_run(config("b", 1), tmp_path / "half"))
    calls = _count_sampled(monkeypatch)
    resumed = resume_run(half.run_dir, {"steps": 3})
    assert calls == []  # presampling and the teacher found everything in the store
    saved = torch.load(half.run_dir / "checkpoints" / "step_000001" / "pvpo.pt", weights_only=True)
    pvpo = resumed.components["pvpo"]
    assert pvpo.presample_rollouts == saved["presample_rollouts"] == 16
    assert pvpo.anchor_key == saved["anchor_key"]
    train(resumed)
    assert sum(calls) == 2 * 2 * len(pvpo.records)  # the refreshes before steps 2 and 3

    def values(run):
        return [
            {k: v for k, v in r.items() if not k.startswith("time/") and "seconds" not in k}
            for r in read_metrics(run.run_dir)
        ]

    assert values(straight) == values(resumed)
    assert pvpo.anchor_key == straight.components["pvpo"].anchor_key


def test_anchors_topped_up_by_a_larger_m_are_announced(parity, tiny, tmp_path, caplog) -> None:
    """The store holds sufficient statistics, so a run with pvpo.m = 2 after one with 3 on
    the same store uses all three rollouts of each prompt: it says so."""
    extra = ("pvpo.teacher=none", "pvpo.keep_unsolved=true")
    start_run(load_config(PAPER, _overrides(tiny, tmp_path, *extra, "pvpo.m=3")), tmp_path / "a")
    assert "rest on more than" not in caplog.text
    run = start_run(load_config(PAPER, _overrides(tiny, tmp_path, *extra)), tmp_path / "b")
    pvpo = run.components["pvpo"]
    assert {stat.n for stat in pvpo.anchors.values()} == {3}
    n = len(pvpo.records)
    assert f"{n} of {n} training prompts' anchors rest on more than pvpo.m = 2 rollouts" in (
        caplog.text
    )


def test_every_seed_shares_one_anchor_draw_unless_presample_seed_is_set(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    store, seeds = tmp_path / "shared.db", []
    real_call = RolloutSampler.__call__

    def recording(self, records, n, first, seed):
        seeds.append(seed[0])  # (anchor seed, stream)
        return real_call(self, records, n, first, seed)

    monkeypatch.setattr(RolloutSampler, "__call__", recording)
    reference = tmp_path / "reference"  # one reference for every seed (random:tiny is seeded)
    tokenizer = build_tokenizer()
    save_policy(build_model("tiny", tokenizer, seed=0), tokenizer, reference)

    def set_up(name: str, *extra: str):
        seeds.clear()
        overrides = [*tiny, f"model={reference}", "pvpo.m=2", f"pvpo.store={store}", *extra]
        cfg = load_config(PAPER, overrides)
        return start_run(cfg, tmp_path / name).components["pvpo"], list(seeds)

    zero, drawn_zero = set_up("zero", "seed=0")
    shared, drawn_shared = set_up("shared", "seed=1")
    own, drawn_own = set_up("own", "seed=0", "pvpo.presample_seed=1")
    assert drawn_zero and set(drawn_zero) == {0}  # the anchor seed is 0 by default
    assert drawn_shared == [] and shared.anchor_key == zero.anchor_key  # one draw, reused
    assert drawn_own and set(drawn_own) == {1}
    assert own.anchor_key != zero.anchor_key  # two draws, two keys: never mixed


def test_a_presampling_dearer_than_the_run_is_announced() -> None:
    assert presample_cost_note(800, 8, 800, 6400) is None  # 6,400 = the run's own rollouts
    assert presample_cost_note(800, 8, 800, 1600) is None  # dearer, but only prompts it draws
    note = presample_cost_note(30_000, 8, 800, 6400)
    assert note is not None and note.startswith(
        "PVPO presamples 30,000 training prompts x M=8 = 240,000 reference rollouts, 37.5x "
        "the 6,400 policy rollouts of the run, which draws at most 800 prompts"
    )
    assert "pvpo.prompts=auto" in note


def test_the_walk_target_comes_from_pvpo_prompts() -> None:
    def target(*overrides: str, available: int = 30_000):
        cfg = load_config("pvpo", ["steps=100", *overrides])
        return pool_target(cfg.pvpo, cfg.steps * cfg.rollout.prompts_per_step, available)

    assert target() == 100 * 8  # auto: each prompt the run draws, once
    assert target("pvpo.prompts=300") == 300
    assert target("pvpo.prompts=all") is None
    assert target(available=500) is None  # fewer prompts than the run draws: all of them
    with pytest.raises(ConfigError, match="pvpo.prompts"):
        load_config("pvpo", ["pvpo.prompts=0"])


def test_the_walk_presamples_only_the_prompts_the_run_draws(
    parity, tiny, tmp_path, monkeypatch
) -> None:
    calls = _count_sampled(monkeypatch)
    # 1 step x 2 prompts: the walk stops once group sampling would keep 2 prompts
    cfg = load_config(PAPER, _overrides(tiny, tmp_path, "steps=1", "pvpo.presample_batch=1"))
    run = start_run(cfg, tmp_path / "run")
    pvpo = run.components["pvpo"]
    walked = [r.id for r in pvpo.set.records]
    order = [r.id for r in walk_order(parity.records("train"), cfg.seed)]
    assert walked == order[: len(walked)] and len(walked) < len(order)
    passing = [p for p in walked if not pvpo.set.stats[p].all_correct]  # the oracle solves acc 0
    assert [r.id for r in pvpo.records] == [r.id for r in run.sampler.records] == passing[:2]
    assert len(passing) >= 2
    assert sum(calls) == 2 * len(walked) == pvpo.presample_rollouts  # M = 2 per walked prompt
    assert json.loads((run.run_dir / "pvpo.json").read_text())["walk_target"] == 2
    assert set(pvpo.trajectories) <= set(passing)


def test_pvpo_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="pvpo.teacher"):
        load_config("pvpo", ["pvpo.teacher=gpt"])
    with pytest.raises(ConfigError, match="pvpo.teacher_model"):
        load_config("pvpo", ["pvpo.teacher=http:http://127.0.0.1:8000/v1"])
    with pytest.raises(ConfigError, match="pvpo.refresh_mode"):
        load_config("pvpo", ["pvpo.refresh_mode=critic"])
    mixed = load_config("grpo", ["filter.kind=group"])  # group sampling with GRPO's baseline
    assert mixed.advantage.estimator == "grpo" and mixed.pvpo.m == 8


@pytest.mark.slow
def test_pvpo_paper_preset_trains_one_step_on_arithmetic_from_the_cli(tmp_path) -> None:
    out = tmp_path / "cli"
    args = [
        "train", "--preset", "pvpo_paper", "model=random:tiny", "train_prompts=4", "steps=1",
        "rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8",
        "eval.prompts=2", "eval.every=1", "pvpo.m=3", "log.progress=false", "--out", str(out),
    ]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    step = read_metrics(out)[1]
    # a random init never solves arithmetic: every prompt is trained with the oracle's trace
    assert step["rollouts/presample"] == 4 * 3
    assert step["rollouts/cumulative"] == 2 * 2
    assert step["rollouts/total"] == 4 * 3 + 2 * 2
    assert step["pvpo/teacher_rows"] == 2 and step["pvpo/anchor_mean"] == 0.0
    assert step["advantage/mean"] > 0  # the teacher rows: r - V = 1 - 0
    assert json.loads((out / "pvpo_filter.json").read_text())["counts"]["with_teacher"] == 4
    assert json.loads((out / "pvpo.json").read_text())["reference_accuracy"] == 0.0
    assert (tmp_path / "cache" / "anchors.db").is_file()  # the shared store by default


@pytest.mark.slow
def test_a_local_hf_teacher_supplies_verified_trajectories(parity, tiny, tmp_path) -> None:
    extra = ("pvpo.teacher=hf:random:tiny", "pvpo.teacher_tries=4")
    cfg = load_config(PAPER, _overrides(tiny, tmp_path, *extra))
    _seed_store(cfg, parity, tmp_path / "anchors.db", CORRECT)
    run = start_run(cfg, tmp_path / "run")
    trajectories = run.components["pvpo"].trajectories
    assert trajectories  # a random init writes an even first character half the time
    for pid, traj in trajectories.items():
        assert pid in IDS[4:] and traj.teacher == "hf" and 1 <= traj.tries <= 4
        assert parity.correct(traj.text, Record(pid, "q", "even"))
    solved = set(trajectories)
    assert [r.id for r in run.sampler.records] == [*IDS[2:4], *(p for p in IDS[4:] if p in solved)]


def test_an_http_teacher_is_built_from_its_url_and_model(parity) -> None:
    from anchor_rl.anchors.teachers import OpenAITeacher
    from anchor_rl.trainer.pvpo import build_teacher, presample_params

    cfg = load_config(
        "pvpo",
        [
            "pvpo.teacher=http:http://127.0.0.1:9/v1",
            "pvpo.teacher_model=big",
            "pvpo.teacher_tries=3",
        ],
    )
    teacher = build_teacher(cfg, parity, build_tokenizer(), None, presample_params(cfg, parity))
    assert isinstance(teacher, OpenAITeacher)
    assert (teacher.url, teacher.model, teacher.tries) == (
        "http://127.0.0.1:9/v1/completions",
        "big",
        3,
    )
    assert (
        build_teacher(
            load_config("pvpo", ["pvpo.teacher=none"]), parity, build_tokenizer(), None, None
        )
        is None
    )
