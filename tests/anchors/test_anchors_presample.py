"""presample / refresh_anchors: batching, resumption (incl. a real kill -9), top-ups, keys."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from anchor_fakes import EchoTask

from anchor_rl.anchors.keys import AnchorKey, fingerprint_model, task_identity
from anchor_rl.anchors.presample import (
    RolloutSampler,
    presample,
    presample_key,
    refresh_anchors,
    refresh_key,
    task_params,
)
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record

KEY = AnchorKey(model="ref", tokenizer="tok", sampling={"temperature": 1.0}, task="echo")
WORKER = Path(__file__).with_name("presample_worker.py")


def records(n: int) -> list[Record]:
    return [Record(id=f"r{i}", prompt=f"prompt {i}", answer="") for i in range(n)]


class TableSampler:
    """Prompt ``r{i}``: the first ``i % 3`` rollouts of every call are correct (reward 1), the rest 0.

    Records each call as ``(ids, n, first, seed)``.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[list[str], int, list[int], object]] = []

    def __call__(self, batch, n, first, seed):
        self.calls.append(([r.id for r in batch], n, list(first), seed))
        solved = torch.tensor([int(r.id[1:]) % 3 for r in batch])
        correct = torch.arange(n)[None, :] < solved[:, None]
        return correct.double(), correct


@pytest.fixture
def store(tmp_path):
    with AnchorStore(tmp_path / "anchors.db") as s:
        yield s


def test_presample_stores_hand_computed_anchors_in_batches(store):
    sampler = TableSampler()
    seen_rows: list[int] = []
    reader = sqlite3.connect(store.path)

    def spying(batch, n, first, seed):
        seen_rows.append(reader.execute("SELECT COUNT(*) FROM stats").fetchone()[0])
        return sampler(batch, n, first, seed)

    result = presample(records(7), spying, store, KEY, m=4, batch_size=3, progress=False)
    assert (result.rollouts, result.prompts_sampled, result.prompts_reused) == (28, 7, 0)
    assert result.key == KEY.digest
    assert [call[0] for call in sampler.calls] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert {call[3] for call in sampler.calls} == {(0, KEY.digest)}  # base seed and key
    assert seen_rows == [0, 3, 6]  # each batch committed before the next one is sampled
    stats = store.get_anchors(KEY)
    assert {pid: (s.n, s.n_correct, s.mean) for pid, s in stats.items()} == {
        "r0": (4, 0, 0.0),
        "r1": (4, 1, 0.25),
        "r2": (4, 2, 0.5),
        "r3": (4, 0, 0.0),
        "r4": (4, 1, 0.25),
        "r5": (4, 2, 0.5),
        "r6": (4, 0, 0.0),
    }
    reader.close()


def test_rerun_reuses_and_topup_adds_only_the_missing_rollouts(store):
    first = TableSampler()
    presample(records(4), first, store, KEY, m=4, batch_size=2, progress=False)
    again = TableSampler()
    result = presample(records(4), again, store, KEY, m=4, batch_size=2, progress=False)
    assert (result.rollouts, result.prompts_reused, again.calls) == (0, 4, [])

    more = TableSampler()
    result = presample(records(5), more, store, KEY, m=6, batch_size=8, progress=False)
    # r0..r3 need 2 more each, r4 (new) needs 6: two calls grouped by need
    assert [call[:2] for call in more.calls] == [(["r0", "r1", "r2", "r3"], 2), (["r4"], 6)]
    assert (result.rollouts, result.prompts_sampled) == (4 * 2 + 6, 5)
    stats = store.get_anchors(KEY)
    assert stats["r2"].n == 6 and stats["r2"].n_correct == 2 + 2  # 2 of the first 4, then 2 of 2
    assert stats["r4"].n == 6 and stats["r4"].n_correct == 1
    # a top-up continues each prompt's sample numbering: it never replays the rollouts it
    # is added to (rollout j of a prompt is seeded by its number j)
    assert [call[2] for call in more.calls] == [[4, 4, 4, 4], [0]]
    assert {tuple(call[2]) for call in first.calls} == {(0, 0)}


def test_a_prompt_another_writer_stored_meanwhile_is_not_merged_twice(store):
    sampler = TableSampler()

    def racing(batch, n, first, seed):
        if [r.id for r in batch] == ["r0", "r1"]:  # another process finishes r1 meanwhile
            with AnchorStore(store.path) as other:
                other.add_rollouts(KEY, ["r1"], [[1.0, 1.0, 1.0]], [[True, True, True]])
        return sampler(batch, n, first, seed)

    result = presample(records(3), racing, store, KEY, m=3, batch_size=2, progress=False)
    assert (result.rollouts, result.prompts_discarded) == (9, 1)
    stats = store.get_anchors(KEY)
    assert stats["r1"].n == 3 and stats["r1"].n_correct == 3  # only the other writer's rows
    assert stats["r0"].n == 3 and stats["r2"].n == 3


class TextSumTask(EchoTask):
    """A reward that a random-init model's completions spread over [0, 1]: the code-point sum
    of the completion mod 5, over 4 (so equal statistics mean equal texts, almost surely)."""

    def reward(self, completion, record):
        return (sum(map(ord, completion)) % 5) / 4


def test_the_stored_anchors_do_not_depend_on_the_batching(tmp_path, tokenizer, tiny_model):
    task = TextSumTask(n=5)
    params = SamplingParams(max_new_tokens=6)
    sampler = RolloutSampler(make_engine("hf", tiny_model, tokenizer), task, params)
    key = presample_key(tiny_model, tokenizer, task_params(params, task), "echo")
    recs = task.records("train")
    stats = []
    for batch_size in (1, 4):
        with AnchorStore(tmp_path / f"b{batch_size}.db") as s:
            presample(recs, sampler, s, key, m=3, batch_size=batch_size, seed=7, progress=False)
            stats.append(
                {pid: (st.n, st.reward_sum, st.n_correct) for pid, st in s.get_anchors(key).items()}
            )
    assert stats[0] == stats[1] and len(stats[0]) == len(recs)
    assert len({sums for _, sums, _ in stats[0].values()}) > 1  # the rollouts differ


def test_presample_input_errors(store):
    with pytest.raises(ValueError, match="duplicate record ids"):
        presample([*records(2), *records(1)], TableSampler(), store, KEY, m=2, progress=False)
    with pytest.raises(ValueError, match="m must be"):
        presample(records(2), TableSampler(), store, KEY, m=0, progress=False)

    def wrong(batch, n, first, seed):
        return torch.zeros(len(batch), n + 1), torch.zeros(len(batch), n + 1, dtype=torch.bool)

    with pytest.raises(ValueError, match="expected"):
        presample(records(2), wrong, store, KEY, m=2, progress=False)


def test_refresh_stores_under_a_distinct_key_and_counts_rollouts(store):
    presample(records(3), TableSampler(), store, KEY, m=2, progress=False)
    first = refresh_anchors(records(3), TableSampler(), store, KEY, mode="reference", step=500, m=4)
    assert first.rollouts == 12 and first.key.tag == "refresh/reference/step=500"
    assert first.key.model == KEY.model and first.key.digest != KEY.digest
    assert {pid: s.n for pid, s in first.anchors.items()} == {"r0": 4, "r1": 4, "r2": 4}
    assert {s.n for s in store.get_anchors(KEY).values()} == {2}  # original anchors untouched
    resumed = refresh_anchors(
        records(3), TableSampler(), store, KEY, mode="reference", step=500, m=4
    )
    assert resumed.rollouts == 0 and resumed.key == first.key

    policy = refresh_anchors(
        records(3),
        TableSampler(),
        store,
        KEY,
        mode="policy",
        step=500,
        m=2,
        model_fingerprint="snap",
    )
    assert (
        policy.rollouts == 6
        and policy.key.model == "snap"
        and policy.key.tag == "refresh/policy/step=500"
    )
    with pytest.raises(ValueError, match="fingerprint of the policy snapshot"):
        refresh_key(KEY, "policy", 500)
    with pytest.raises(ValueError, match="must match"):
        refresh_key(KEY, "reference", 500, model_fingerprint="other")
    with pytest.raises(ValueError, match="unknown refresh mode"):
        refresh_key(KEY, "critic", 500)  # type: ignore[arg-type]


def test_rollout_sampler_with_a_tiny_model(tmp_path, tokenizer, tiny_model, task):
    params = SamplingParams(max_new_tokens=6)
    sampler = RolloutSampler(make_engine("hf", tiny_model, tokenizer), task, params)
    assert sampler.params.stop == ["</answer>"]  # the task's stop added
    recs = task.records("train")[:3]
    rewards, correct = sampler(recs, 2, [0, 0, 0], seed=11)
    assert rewards.shape == (3, 2) and correct.shape == (3, 2) and correct.dtype == torch.bool
    assert set(rewards.flatten().tolist()) <= {0.0, 1.0}
    again, _ = sampler(recs, 2, [0, 0, 0], seed=11)
    assert torch.equal(rewards, again)

    key = presample_key(
        tiny_model, tokenizer, task_params(params, task), task_identity("echo", task)
    )
    assert key.model == fingerprint_model(tiny_model) and key.sampling["stop"] == ["</answer>"]
    other = presample_key(
        tiny_model, tokenizer, task_params(SamplingParams(max_new_tokens=7), task), key.task
    )
    assert other.digest != key.digest
    with AnchorStore(tmp_path / "a.db") as s:
        result = presample(recs, sampler, s, key, m=2, batch_size=2, progress=False)
        assert result.rollouts == 6
        assert s.get_anchors(other, [r.id for r in recs]) == {}
        assert {st.n for st in s.get_anchors(key).values()} == {2}


def _committed(db: Path) -> set[str]:
    if not db.exists():
        return set()
    conn = sqlite3.connect(db, timeout=5)
    try:
        return {row[0] for row in conn.execute("SELECT prompt_id FROM stats")}
    except sqlite3.OperationalError:  # schema not created yet
        return set()
    finally:
        conn.close()


def test_kill_minus_nine_then_rerun_finishes_without_redoing(tmp_path):
    db, log1, log2 = tmp_path / "kill.db", tmp_path / "run1.log", tmp_path / "run2.log"
    prompts, m = 240, 4
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(db), str(log1), str(prompts), str(m), "4", "0.02"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 60
    try:
        while len(_committed(db)) < 20:
            assert proc.poll() is None, f"worker exited early: {proc.stderr.read().decode()}"
            assert time.monotonic() < deadline, "worker made no progress"
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done_before = _committed(db)
    assert 20 <= len(done_before) < prompts, "the kill must land mid-run"

    rerun = subprocess.run(
        [sys.executable, str(WORKER), str(db), str(log2), str(prompts), str(m), "16", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr
    resampled = {pid for line in log2.read_text().splitlines() for pid in line.split()}
    assert resampled.isdisjoint(done_before)  # finished prompts were not redone
    assert resampled | done_before == {f"q{i}" for i in range(prompts)}
    assert f"reused={len(done_before)}" in rerun.stdout

    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    rows = conn.execute("SELECT prompt_id, n, n_correct, reward_sum FROM stats").fetchall()
    conn.close()
    assert sorted(r[0] for r in rows) == sorted(
        f"q{i}" for i in range(prompts)
    )  # each exactly once
    for pid, n, n_correct, reward_sum in rows:
        solved = min(int(pid[1:]) % (m + 1), m)
        assert (n, n_correct, reward_sum) == (m, solved, float(solved)), pid


def test_a_second_process_on_the_same_key_waits_and_samples_nothing(tmp_path):
    db, log1, log2 = tmp_path / "two.db", tmp_path / "first.log", tmp_path / "second.log"
    gate = tmp_path / "go"  # the first job's first call holds until the second one waits
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    args = ["16", "2", "2", "0.05"]  # 16 prompts, M = 2, 2 per call, 0.05 s per call
    first = subprocess.Popen(
        [sys.executable, str(WORKER), str(db), str(log1), *args, str(gate)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not (log1.exists() and log1.read_text()):  # the first one holds the key
        assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
        time.sleep(0.02)
    second = subprocess.Popen(
        [sys.executable, str(WORKER), str(db), str(log2), *args], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    said = ""
    while "waiting for it" not in said:  # the second one reports the holder and waits
        line = second.stderr.readline()
        assert line, f"the second job ended without waiting: {said}"
        said += line
    gate.touch()
    second_out, second_err = second.communicate(timeout=120)
    second_err = said + second_err
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0 and second.returncode == 0, err + second_err
    assert f"process {first.pid} is presampling key" in second_err
    assert "rollouts=0 reused=16" in second_out  # it sampled nothing: all was there
    assert not log2.exists() or log2.read_text() == ""
    assert "rollouts=32" in out
