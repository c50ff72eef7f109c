"""benchmarks/soak.py: the verdicts on synthetic samples of a run, and the sampler's readers."""

from __future__ import annotations

import json
import os
import sqlite3
from pathlib import Path

import pytest
import soak

STEPS, KEEP, EVERY, ROWS = 1000, 2, 200, 32
MIB = 2**20


def run_samples(**change) -> list[dict]:
    """A healthy run sampled every 10 steps: flat memory, descriptors and threads, keep
    checkpoints of 10 MiB (every 100 steps), a refresh after every 200th step; ``change``
    maps a sample field to ``f(step, value) -> value``."""
    samples = []
    for step in range(0, STEPS + 1, 10):
        ckpts = min(step // 100, KEEP)
        refreshes = max(step - 1, 0) // EVERY
        s = dict(t=step / 10, step=step, rows=step, contiguous=True, procs=1,
                 rss_trainer=500 * MIB, rss_tree=800 * MIB, fds_trainer=8, fds_tree=20,
                 threads_trainer=5, threads_tree=40, ckpt_count=ckpts,
                 ckpt_newest=step // 100 * 100, ckpt_bytes=ckpts * 10 * MIB,
                 run_bytes=ckpts * 10 * MIB + 4000 * step,
                 store=dict(keys=2 + refreshes, stats=ROWS * (1 + refreshes), trajectories=ROWS,
                            refreshes=refreshes) if step else None)  # fmt: skip
        for key, f in change.items():
            s[key] = f(step, s[key])
        samples.append(s)
    return samples


def judge(samples: list[dict], final_steps: list[int] | None = None) -> dict[str, bool]:
    v = soak.verdicts(samples, steps=STEPS, keep=KEEP, refresh_every=EVERY, warmup=201,
                      final_steps=list(range(1, STEPS + 1)) if final_steps is None else final_steps,
                      refresh_rows=ROWS)  # fmt: skip
    return {k: r["ok"] for k, r in v.items()}


def test_a_healthy_run_passes_every_criterion() -> None:
    assert judge(run_samples()) == dict.fromkeys(soak.CRITERIA, True)


def test_warmup_growth_and_teardown_do_not_count() -> None:
    # memory doubles during warm-up and halves at the last step (teardown): neither is judged
    rss = lambda step, v: v // 2 if step < 150 or step == STEPS else v  # noqa: E731
    assert judge(run_samples(rss_trainer=rss, rss_tree=rss))["rss"]


@pytest.mark.parametrize("key", ["rss_trainer", "rss_tree"])
def test_memory_growing_past_the_tolerance_fails(key: str) -> None:
    leak = lambda step, v: int(v * (1 + 0.15 * max(step - 200, 0) / 800))  # noqa: E731
    assert not judge(run_samples(**{key: leak}))["rss"]
    small = lambda step, v: int(v * (1 + 0.05 * max(step - 200, 0) / 800))  # noqa: E731
    assert judge(run_samples(**{key: small}))["rss"]


@pytest.mark.parametrize("name", ["fds", "threads"])
def test_descriptors_or_threads_growing_fail_and_a_spike_does_not(name: str) -> None:
    leak = lambda step, v: v + step // 100  # noqa: E731  # one per checkpoint
    assert not judge(run_samples(**{f"{name}_tree": leak}))[name]
    spike = lambda step, v: v + 6 if step % 100 == 0 else v  # noqa: E731  # while saving
    assert judge(run_samples(**{f"{name}_tree": spike}))[name]


def test_threads_verdict_names_the_process_and_thread_that_grew() -> None:
    samples = run_samples(threads_tree=lambda step, v: v + 3 * (step > 600))
    for s in samples:
        grew = 3 * (s["step"] > 600)
        s["threads_by_role"] = {"trainer": 5, "raylet": 35 + grew}
        s["thread_names"] = {"trainer/python": 5, "raylet/raylet": 3,
                             "raylet/client.poll0": 32 + grew}  # fmt: skip
    v = soak.verdicts(samples, steps=STEPS, keep=KEEP, refresh_every=EVERY, warmup=201,
                      final_steps=list(range(1, STEPS + 1)), refresh_rows=ROWS)  # fmt: skip
    assert not v["threads"]["ok"]
    assert v["threads"]["by_role"] == {"raylet": [35, 38]}
    assert v["threads"]["by_name"] == {"raylet/client.poll0": [32, 35]}


def test_checkpoints_beyond_keep_fail() -> None:
    unbounded = dict(ckpt_count=lambda step, v: step // 100,
                     ckpt_bytes=lambda step, v: step // 100 * 10 * MIB)  # fmt: skip
    assert not judge(run_samples(**unbounded))["disk"]
    # keep + 1 while the newest is published before the oldest goes is allowed
    assert judge(run_samples(ckpt_count=lambda step, v: v + (step == 500)))["disk"]
    assert not judge(run_samples(ckpt_bytes=lambda step, v: v * (1 + step / 1000)))["disk"]


def test_metrics_rows_missing_or_lagging_fail() -> None:
    assert not judge(run_samples(), final_steps=list(range(1, STEPS)))["metrics"]
    assert not judge(run_samples(), final_steps=[*range(1, 500), *range(501, STEPS + 2)])["metrics"]
    assert not judge(run_samples(contiguous=lambda step, v: step != 300))["metrics"]
    # a checkpoint on disk ahead of the metrics rows read after it
    assert not judge(run_samples(rows=lambda step, v: v - 1 if step == 300 else v,
                                 step=lambda step, v: v - 1 if step == 300 else v))["metrics"]  # fmt: skip


def test_store_not_keeping_pace_fails() -> None:
    def stale(step: int, store: dict | None) -> dict | None:  # the refreshes stop at step 600
        if store is None or step <= 600:
            return store
        return dict(store, refreshes=2, keys=4, stats=3 * ROWS)

    assert not judge(run_samples(store=stale))["store"]

    def rowless(step: int, store: dict | None) -> dict | None:  # refresh keys without rows
        return store and dict(store, stats=ROWS)

    assert not judge(run_samples(store=rowless))["store"]
    v = soak.verdicts(run_samples(), steps=STEPS, keep=KEEP, refresh_every=0, warmup=201,
                      final_steps=list(range(1, STEPS + 1)))  # fmt: skip
    assert v["store"]["ok"] is None


def test_readers_see_complete_rows_the_store_and_this_process(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics.jsonl"
    reader = soak.MetricsReader(metrics)
    assert reader.read() == []
    metrics.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert reader.read() == [1, 2]
    with open(metrics, "a") as f:
        f.write('ep": 3}\n')
    assert reader.read() == [1, 2, 3]

    db = tmp_path / "anchors.db"
    assert soak.store_rows(db) is None
    con = sqlite3.connect(db)
    con.executescript("CREATE TABLE keys (tag TEXT); CREATE TABLE stats (x); "
                      "CREATE TABLE trajectories (x); INSERT INTO keys VALUES ('presample'), "
                      "('refresh/reference/step=200'); INSERT INTO stats VALUES (1), (2);")  # fmt: skip
    con.commit()
    con.close()
    assert soak.store_rows(db) == dict(keys=2, stats=2, trajectories=0, refreshes=1)

    assert soak._role(False, ["ray::RolloutWorker.rollout"]) == "ray::RolloutWorker"
    assert soak._role(False, ["/venv/bin/python", "/ray/dashboard/agent.py"]) == "python agent.py"
    assert soak._role(False, ["/venv/bin/python", "-u", "/ray/monitor.py"]) == "python monitor.py"
    for tree in (soak._proc_tree, soak._proc_tree_linux):
        (me,) = [p for p in tree(os.getpid()) if p["role"] == "trainer"]
        assert me["pid"] == os.getpid() and me["rss"] > 0 and me["fds"] > 0 and me["threads"] >= 1
        assert sum(me["names"].values()) >= 1


def test_table_lists_each_result(tmp_path: Path) -> None:
    v = soak.verdicts(run_samples(), steps=STEPS, keep=KEEP, refresh_every=EVERY, warmup=201,
                      final_steps=list(range(1, STEPS + 1)), refresh_rows=ROWS)  # fmt: skip
    for name in ("inprocess", "ray2"):
        result = dict(name=name, steps=STEPS, step_s_median=0.2, warmup_steps=201, verdicts=v)
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    lines = soak.table(tmp_path).splitlines()
    assert [line.split("|")[1].strip() for line in lines[2:]] == ["inprocess", "ray2"]
    assert "metrics ok" in lines[2] and "FAIL" not in lines[2]
