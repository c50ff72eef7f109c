"""The CLI: ``anchor-rl presample`` end to end and ``anchor-rl anchors {export,keys,filter}``."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
from typer.testing import CliRunner

from anchor_rl.anchors.keys import AnchorKey
from anchor_rl.anchors.store import AnchorStore
from anchor_rl.cli import app

KEY = AnchorKey(model="m", tokenizer="t", sampling={"top_p": 1.0}, task="echo")
runner = CliRunner(env={"COLUMNS": "300"})


def test_export_and_keys(tmp_path):
    db = tmp_path / "a.db"
    with AnchorStore(db) as store:
        store.add_rollouts(KEY, ["x", "y"], [[1.0, 0.0], [1.0, 1.0]], [[1, 0], [1, 1]])
    out = runner.invoke(app, ["anchors", "export", str(db), "--out", str(tmp_path / "a.jsonl")])
    assert out.exit_code == 0, out.output
    rows = [json.loads(line) for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert [(r["prompt_id"], r["mean_reward"], r["accuracy"]) for r in rows] == [
        ("x", 0.5, 0.5),
        ("y", 1.0, 1.0),
    ]
    out = runner.invoke(
        app,
        [
            "anchors",
            "export",
            str(db),
            "--out",
            str(tmp_path / "t.parquet"),
            "--table",
            "trajectories",
        ],
    )
    assert out.exit_code == 0 and pq.read_table(tmp_path / "t.parquet").num_rows == 0
    out = runner.invoke(app, ["anchors", "export", str(db), "--out", str(tmp_path / "a.csv")])
    assert out.exit_code != 0 and ".jsonl or .parquet" in out.output
    out = runner.invoke(app, ["anchors", "keys", str(db)])
    assert out.exit_code == 0 and KEY.digest[:8] in out.output and "presample" in out.output


def test_export_takes_a_key_by_its_printed_prefix(tmp_path):
    db = tmp_path / "a.db"
    other = KEY.replace(task="other")
    with AnchorStore(db) as store:
        store.add_rollouts(KEY, ["x"], [[1.0]], [[1]])
        store.add_rollouts(other, ["x", "y"], [[0.0], [1.0]], [[0], [1]])
    out = tmp_path / "k.jsonl"
    done = runner.invoke(
        app, ["anchors", "export", str(db), "-o", str(out), "--key", KEY.digest[:12]]
    )
    assert done.exit_code == 0 and done.output.startswith("1 rows"), done.output
    assert json.loads(out.read_text())["prompt_id"] == "x"
    bad = runner.invoke(app, ["anchors", "export", str(db), "-o", str(out), "--key", "zz"])
    assert bad.exit_code == 2 and "no key of" in bad.output and KEY.digest[:12] in bad.output
    common = os.path.commonprefix([KEY.digest, other.digest])
    both = runner.invoke(app, ["anchors", "export", str(db), "-o", str(out), "--key", common])
    assert both.exit_code == 2 and "2 keys of" in both.output


def test_presample_command_resumes_and_filter_reads_its_key(tmp_path, monkeypatch):
    db = tmp_path / "anchors.db"
    common = [
        "--model",
        "random:tiny",
        "--task",
        "arithmetic",
        "--limit",
        "4",
        "--db",
        str(db),
        "--max-new-tokens",
        "6",
    ]
    args = [*common, "--m", "2", "--batch-size", "2"]
    first = runner.invoke(app, ["presample", *args, "--export", str(tmp_path / "a.parquet")])
    assert first.exit_code == 0, first.output
    assert "sampled 8 rollouts for 4 prompts (0 already held M = 2 or more)" in first.output
    assert pq.read_table(tmp_path / "a.parquet").num_rows == 4
    again = runner.invoke(app, ["presample", *args])
    assert again.exit_code == 0
    assert "sampled 0 rollouts for 0 prompts (4 already held M = 2 or more)" in again.output
    other = runner.invoke(app, ["presample", *args, "--temperature", "0.5"])
    assert (
        other.exit_code == 0 and "sampled 8 rollouts" in other.output
    )  # other settings, other key

    stats_file = tmp_path / "filter.json"
    out = runner.invoke(
        app, ["anchors", "filter", *common, "--teacher", "oracle", "--stats-out", str(stats_file)]
    )
    assert out.exit_code == 0, out.output
    counts = json.loads(stats_file.read_text())["counts"]
    assert counts["total"] == 4 and counts["teacher"] == "oracle"
    assert counts["acc_zero"] + counts["acc_mixed"] + counts["acc_one"] == 4
    assert "49.8%" in out.output
    missing = runner.invoke(app, ["anchors", "filter", *common, "--top-p", "0.9"])
    assert missing.exit_code != 0 and "presample" in missing.output

    # another anchor seed still seeds the teacher as the trainer does (one teacher key)
    from anchor_rl.anchors import teachers
    from anchor_rl.methods import pvpo  # the trainer's pvpo_teacher builds the CLI's teacher

    seeds, make = [], teachers.make_teacher
    monkeypatch.setattr(
        pvpo, "make_teacher", lambda *a, **k: seeds.append(k["seed"]) or make(*a, **k)
    )
    assert runner.invoke(app, ["presample", *args, "--seed", "3"]).exit_code == 0
    out = runner.invoke(app, ["anchors", "filter", *common, "--seed", "3", "--teacher", "oracle"])
    assert out.exit_code == 0, out.output
    assert seeds == [teachers.TEACHER_SEED]


def test_presample_defaults_are_the_presets_so_training_finds_the_anchors(tmp_path):
    from anchor_rl.rollout.spec import load_spec
    from anchor_rl.trainer.config import load_config
    from anchor_rl.trainer.pvpo import reference_key
    from anchor_rl.trainer.run import load_task

    db = tmp_path / "anchors.db"
    args = ["presample", "--model", "random:tiny", "--limit", "3", "--m", "2", "--db", str(db)]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "max_new_tokens 80" in first.output and "no anchors under this key yet" in first.output
    cfg = load_config("pvpo", ["model=random:tiny"])
    task = load_task(cfg)
    policy, tokenizer = load_spec("random:tiny", cfg.task, cfg.task_args, 0, "cpu")
    key = reference_key(cfg, task, tokenizer, policy)
    ids = [r.id for r in task.records("train")[:3]]
    with AnchorStore(db) as store:
        assert sorted(store.get_anchors(key, ids)) == sorted(ids)  # where training looks

    shorter = runner.invoke(app, [*args, "--max-new-tokens", "64"])
    assert shorter.exit_code == 0, shorter.output
    text = " ".join(shorter.output.split())
    assert f"other sampling settings: {key.digest[:12]} (max_new_tokens 80)" in text
    again = runner.invoke(app, args)
    assert "reusing the anchors of 3 of 3 prompts already under this key" in again.output
    more = " ".join(runner.invoke(app, [*args[:-4], "--m", "3", "--db", str(db)]).output.split())
    assert "3 of 3 prompts already under this key, 3 of them to be topped up to M = 3" in more
    assert "sampled 3 rollouts for 3 prompts (0 already held M = 3 or more)" in more
    fewer = " ".join(runner.invoke(app, args).output.split())  # M = 2 on rows of 3
    assert "(M = 2; stored n = 3)" in fewer
