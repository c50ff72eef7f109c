"""AnchorStore: round trips, WAL mode, transactions, key isolation, trajectories and export."""

from __future__ import annotations

import json
import math
import sqlite3

import pyarrow.parquet as pq
import pytest
import torch

from anchor_rl.anchors.keys import (
    AnchorKey,
    fingerprint_model,
    fingerprint_tokenizer,
    sampling_settings,
)
from anchor_rl.anchors.records import AnchorStat, TeacherTrajectory, anchor_values
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.models.factory import build_model
from anchor_rl.models.loading import load_policy, save_policy
from anchor_rl.rollout.types import SamplingParams

KEY = AnchorKey(model="m0", tokenizer="t0", sampling={"temperature": 1.0}, task="echo")


@pytest.fixture
def store(tmp_path):
    with AnchorStore(tmp_path / "anchors.db") as s:
        yield s


def traj(pid: str = "p0", n: int = 4, tool: bool = False) -> TeacherTrajectory:
    mask = torch.ones(n)
    if tool:
        mask[1:3] = 0
    return TeacherTrajectory(
        prompt_id=pid,
        token_ids=torch.arange(10, 10 + n),
        logprobs=-0.25 * torch.arange(1, n + 1, dtype=torch.float32) * mask,
        loss_mask=mask,
        text="<answer>x</answer>",
        reward=1.0,
        teacher="oracle",
        tries=2,
    )


def test_rollouts_merge_into_hand_computed_stats(store):
    store.add_rollouts(
        KEY, ["a", "b"], [[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]], [[1, 0, 1, 1], [0, 0, 0, 0]]
    )
    store.add_rollouts(
        KEY, ["b", "c"], torch.tensor([[1.0, 0.5], [0.2, 0.2]]), torch.tensor([[1, 0], [0, 0]])
    )
    got = store.get_anchors(KEY, ["a", "b", "c", "zzz"])
    assert set(got) == {"a", "b", "c"}
    a, b, c = got["a"], got["b"], got["c"]
    assert (a.n, a.n_correct, a.mean, a.accuracy) == (4, 3, 0.75, 0.75)
    assert a.std == pytest.approx(math.sqrt(0.75 - 0.75**2))  # rewards 1,0,1,1
    assert (b.n, b.n_correct) == (6, 1)  # 4 zeros, then 1.0 and 0.5
    assert b.mean == pytest.approx(1.5 / 6)
    assert b.reward_sq_sum == pytest.approx(1.25)
    assert not b.all_correct and not b.none_correct
    assert (c.n, c.mean, c.none_correct) == (2, pytest.approx(0.2), True)
    assert c.std == pytest.approx(0.0, abs=1e-7)
    assert b.updated >= b.created
    assert store.get_anchors(KEY.digest).keys() == {"a", "b", "c"}  # all rows, by digest


def test_reopen_reads_the_same_rows(tmp_path):
    path = tmp_path / "a.db"
    with AnchorStore(path) as s:
        s.add_rollouts(KEY, ["a"], [[1.0, 1.0]], [[True, True]])
    with AnchorStore(path) as s:
        stat = s.get_anchors(KEY, ["a"])["a"]
    assert (stat.n, stat.n_correct, stat.mean, stat.all_correct) == (2, 2, 1.0, True)


def test_wal_mode_is_on_and_persistent(store):
    other = sqlite3.connect(store.path)
    assert other.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    other.close()


def test_batch_is_one_transaction_and_rolls_back_on_error(store):
    reader = sqlite3.connect(store.path)
    count = lambda: reader.execute("SELECT COUNT(*) FROM stats").fetchone()[0]  # noqa: E731
    with store.batch():
        store.add_rollouts(KEY, ["a"], [[1.0]], [[True]])
        store.add_rollouts(KEY, ["b"], [[0.0]], [[False]])
        assert count() == 0  # nothing visible before the outer block commits
    assert count() == 2
    with pytest.raises(RuntimeError, match="boom"), store.batch():
        store.add_rollouts(KEY, ["c"], [[1.0]], [[True]])
        store.add_rollouts(KEY, ["a"], [[1.0]], [[True]])
        raise RuntimeError("boom")
    assert count() == 2
    assert store.get_anchors(KEY, ["a"])["a"].n == 1  # the merge into "a" was rolled back too
    reader.close()


def test_add_rollouts_rejects_bad_input(store):
    with pytest.raises(ValueError, match="rewards must be"):
        store.add_rollouts(KEY, ["a", "b"], [[1.0]], [[True]])
    with pytest.raises(ValueError, match="correct has shape"):
        store.add_rollouts(KEY, ["a"], [[1.0, 0.0]], [[True]])
    with pytest.raises(ValueError, match="finite"):
        store.add_rollouts(KEY, ["a"], [[float("nan")]], [[True]])
    with pytest.raises(ValueError, match="unique"):
        store.add_rollouts(KEY, ["a", "a"], [[1.0], [1.0]], [[True], [True]])
    assert store.get_anchors(KEY) == {}


def test_other_keys_find_nothing(store):
    store.add_rollouts(KEY, ["a", "b"], [[1.0], [0.0]], [[True], [False]])
    others = [
        KEY.replace(model="m1"),
        KEY.replace(tokenizer="t1"),
        KEY.replace(sampling={"temperature": 0.6}),
        KEY.replace(task="countdown"),
        KEY.replace(tag="refresh/reference/step=500"),
    ]
    assert len({k.digest for k in [KEY, *others]}) == 6
    for other in others:
        assert store.get_anchors(other, ["a", "b"]) == {}
    assert store.get_anchors(AnchorKey(**KEY.to_dict()), ["a"]).keys() == {
        "a"
    }  # equal key, same rows


def test_a_fresh_lora_is_fingerprinted_as_its_base_model(tokenizer):
    """A LoRA whose B factors are zero samples as its base model, so it shares the base's
    anchors; once an adapter moves, it is another model."""
    import peft  # in the dev extra (anchor-rl[verl])

    base = build_model("tiny", tokenizer, seed=0)
    wrapped = peft.get_peft_model(
        build_model("tiny", tokenizer, seed=0),
        peft.LoraConfig(r=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    assert any("lora_A" in name for name in wrapped.state_dict())
    assert fingerprint_model(wrapped) == fingerprint_model(base)
    with torch.no_grad():
        next(p for n, p in wrapped.named_parameters() if "lora_B" in n)[0, 0] = 0.5
    assert fingerprint_model(wrapped) != fingerprint_model(base)


def test_fingerprints_follow_content(tmp_path, tokenizer):
    m0, m0_again, m1 = (build_model("tiny", tokenizer, seed=s) for s in (0, 0, 1))
    assert fingerprint_model(m0) == fingerprint_model(m0_again) != fingerprint_model(m1)
    save_policy(m0, tokenizer, tmp_path / "ref")
    loaded, loaded_tok = load_policy(tmp_path / "ref")
    assert fingerprint_model(loaded) == fingerprint_model(m0)  # same weights from disk
    assert fingerprint_tokenizer(loaded_tok) == fingerprint_tokenizer(tokenizer)
    with torch.no_grad():
        loaded.model.embed_tokens.weight[0, 0] += 1.0
    assert fingerprint_model(loaded) != fingerprint_model(m0)
    tok2 = load_policy(tmp_path / "ref")[1]
    tok2.chat_template = "{{ messages[0]['content'] }}"
    assert fingerprint_tokenizer(tok2) != fingerprint_tokenizer(tokenizer)
    s1 = sampling_settings(SamplingParams(temperature=1.0, max_new_tokens=8))
    s2 = sampling_settings(SamplingParams(temperature=0.6, max_new_tokens=8))
    assert KEY.replace(sampling=s1).digest != KEY.replace(sampling=s2).digest


def test_trajectories_round_trip_failures_and_replacement(store):
    t0, t1 = traj("p0"), traj("p1", n=5, tool=True)
    store.put_trajectories(KEY, {"p0": t0, "p1": t1, "p2": None}, teacher="oracle", tries=1)
    out = store.get_outcomes(KEY, ["p0", "p1", "p2", "p3"])
    assert set(out) == {"p0", "p1", "p2"} and out["p2"] is None
    back = out["p1"]
    assert torch.equal(back.token_ids, t1.token_ids) and back.token_ids.dtype == torch.long
    assert torch.equal(back.logprobs, t1.logprobs) and back.logprobs.dtype == torch.float32
    assert torch.equal(back.loss_mask, torch.tensor([1.0, 0, 0, 1, 1]))
    assert (back.text, back.reward, back.teacher, back.tries, len(back)) == (
        t1.text,
        1.0,
        "oracle",
        2,
        5,
    )
    assert "p3" not in out
    assert store.get_outcomes(KEY.replace(tag="teacher/hf"), ["p0"]).get("p0") is None
    store.put_trajectories(KEY, {"p2": traj("p2", n=3)}, teacher="oracle", tries=1)
    assert len(store.get_outcomes(KEY, ["p2"])["p2"]) == 3


def test_trajectory_validation():
    with pytest.raises(ValueError, match="non-empty 1-D"):
        TeacherTrajectory(
            "p", torch.zeros(0, dtype=torch.long), torch.zeros(0), torch.zeros(0), "", 1.0, "x"
        )
    with pytest.raises(ValueError, match="logprobs has shape"):
        TeacherTrajectory(
            "p", torch.zeros(3, dtype=torch.long), torch.zeros(2), torch.ones(3), "", 1.0, "x"
        )
    with pytest.raises(ValueError, match="0 where loss_mask is 0"):
        TeacherTrajectory(
            "p",
            torch.zeros(2, dtype=torch.long),
            torch.tensor([-1.0, -1.0]),
            torch.tensor([1.0, 0.0]),
            "",
            1.0,
            "x",
        )
    with pytest.raises(ValueError, match="finite"):
        TeacherTrajectory(
            "p",
            torch.zeros(1, dtype=torch.long),
            torch.tensor([float("-inf")]),
            torch.ones(1),
            "",
            1.0,
            "x",
        )


def test_anchor_values_in_order_and_missing(store):
    store.add_rollouts(KEY, ["a", "b"], [[1.0, 0.0], [0.0, 0.0]], [[1, 0], [0, 0]])
    stats = store.get_anchors(KEY)
    assert anchor_values(stats, ["b", "a", "a"]).tolist() == [0.0, 0.5, 0.5]
    with pytest.raises(KeyError, match="run presample"):
        anchor_values(stats, ["a", "c"])


def test_export_jsonl_and_parquet(store, tmp_path):
    store.add_rollouts(KEY, ["b", "a"], [[1.0, 0.0], [1.0, 1.0]], [[1, 0], [1, 1]])
    store.add_rollouts(KEY.replace(model="m1"), ["a"], [[0.0]], [[0]])
    store.put_trajectories(
        KEY, {"p0": traj("p0", tool=True), "p1": None}, teacher="oracle", tries=1
    )

    assert store.export(tmp_path / "all.jsonl") == 3
    rows = [json.loads(line) for line in (tmp_path / "all.jsonl").read_text().splitlines()]
    mine = [r for r in rows if r["key"] == KEY.digest]
    assert [r["prompt_id"] for r in mine] == ["a", "b"]
    assert mine[1]["mean_reward"] == 0.5 and mine[1]["accuracy"] == 0.5 and mine[1]["n"] == 2
    assert mine[0]["model"] == "m0" and json.loads(mine[0]["sampling"]) == {"temperature": 1.0}
    assert mine[0]["created"] > 0 and mine[0]["task"] == "echo"

    assert store.export(tmp_path / "one.parquet", key=KEY) == 2
    table = pq.read_table(tmp_path / "one.parquet").to_pylist()
    assert [(r["prompt_id"], r["mean_reward"], r["n_correct"]) for r in table] == [
        ("a", 1.0, 2),
        ("b", 0.5, 1),
    ]

    assert store.export(tmp_path / "traj.parquet", table="trajectories") == 2
    tr = {r["prompt_id"]: r for r in pq.read_table(tmp_path / "traj.parquet").to_pylist()}
    assert tr["p0"]["solved"] and tr["p0"]["token_ids"] == [10, 11, 12, 13]
    assert tr["p0"]["loss_mask"] == [1, 0, 0, 1]
    assert tr["p0"]["logprobs"] == pytest.approx([-0.25, 0.0, 0.0, -1.0])
    assert not tr["p1"]["solved"] and tr["p1"]["token_ids"] is None

    with pytest.raises(ValueError, match=".jsonl or .parquet"):
        store.export(tmp_path / "x.csv")


def test_keys_listing(store):
    store.add_rollouts(KEY, ["a", "b"], [[1.0], [0.0]], [[1], [0]])
    (info,) = store.keys()
    assert info["digest"] == KEY.digest and info["stats"] == 2 and info["trajectories"] == 0
    assert info["tag"] == "presample"


def test_stat_properties_hand_example():
    # rewards 0.1, 0.1, 0.1, 0.5, 0.2 (PVPO format floor 0.1, nothing correct)
    s = AnchorStat(
        "x", n=5, n_correct=0, reward_sum=1.0, reward_sq_sum=0.32, created=0.0, updated=0.0
    )
    assert (s.mean, s.accuracy, s.none_correct, s.all_correct) == (0.2, 0.0, True, False)
    assert s.std == pytest.approx(math.sqrt(0.32 / 5 - 0.04))
