"""Sweeps sharing one anchor store: the suite switch, the anchors a run sampled itself, the
cost summary and break-even k (synthetic runs), and a micro sweep end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from anchor_rl.bench.runner import BenchArgs, load_suite, plan, run_suite
from anchor_rl.bench.sweep import (
    break_even,
    holds_from,
    projected_break_even,
    run_cost,
    sweep_markdown,
    sweep_summary,
)
from anchor_rl.trainer.config import ConfigError

SWEEP = """
presets = ["grpo", "pvpo"]
seeds = [0]
shared_anchors = true

[base]
task = "arithmetic"
model = "random:tiny"
train_prompts = 8
steps = 2

[base.rollout]
prompts_per_step = 2
max_new_tokens = 8

[base.eval]
every = 1
prompts = 4

[base.log]
progress = false
tensorboard = false

[per_preset.grpo.rollout]
n = 4

[per_preset.pvpo]   # pvpo_paper's presampling, as the built-in suite sweep pins it
rollout = { n = 2 }
pvpo = { m = 2, presample = "upfront", reuse_presample = false, m_min = "none", anchor_update = "none" }

[variants.lr1]
optim = { lr = 1e-5 }

[variants.lr2]
optim = { lr = 2e-5 }
"""


def _suite(tmp_path, text: str = SWEEP, name: str = "sweep.toml"):
    path = tmp_path / name
    path.write_text(text)
    return load_suite(str(path))


def test_shared_anchors_gives_every_seed_one_draw_from_one_store(tmp_path) -> None:
    text = SWEEP.replace("seeds = [0]", "seeds = [0, 1, 2]")
    specs = plan(_suite(tmp_path, text), tmp_path / "out")
    pvpo = [s.config.pvpo for s in specs if s.label.startswith("pvpo")]
    assert len(pvpo) == 6
    assert {p.presample_seed for p in pvpo} == {0}  # not each seed's own
    assert {p.store for p in pvpo} == {str(tmp_path / "out" / "anchors.db")}
    grpo = [s.config.pvpo for s in specs if s.label.startswith("grpo")]
    assert {(p.presample_seed, p.store) for p in grpo} == {(None, None)}  # reads no anchors
    # without the switch each seed draws its own anchors from the default store
    own = plan(_suite(tmp_path, text.replace("shared_anchors = true", ""), "own.toml"), tmp_path)
    pvpo = [s.config.pvpo for s in own if s.label.startswith("pvpo")]
    assert {p.presample_seed for p in pvpo} == {0, 1, 2} and {p.store for p in pvpo} == {None}
    # a store or seed the suite sets is kept, and applies to every run
    kept = text.replace("m = 2,", 'm = 2, presample_seed = 5, store = "a.db",')
    pvpo = [s.config.pvpo for s in plan(_suite(tmp_path, kept, "kept.toml"), tmp_path)]
    assert {(p.presample_seed, p.store) for p in pvpo if p.store} == {(5, "a.db")}


def test_shared_anchors_refuses_runs_that_would_draw_apart(tmp_path) -> None:
    split = (
        SWEEP.replace('presets = ["grpo", "pvpo"]', 'presets = ["pvpo"]')
        .replace("[per_preset.grpo.rollout]\nn = 4\n", "")
        .replace("optim = { lr = 2e-5 }", "optim = { lr = 2e-5 }\npvpo = { presample_seed = 3 }")
    )
    with pytest.raises(ConfigError, match="one anchor store and one presample_seed"):
        plan(_suite(tmp_path, split), tmp_path)
    with pytest.raises(ConfigError, match="shared_anchors must be true or false"):
        _suite(tmp_path, SWEEP.replace("shared_anchors = true", 'shared_anchors = "yes"'), "b.toml")


def test_the_builtin_sweep_suite_is_a_grid_of_six_configurations(tmp_path) -> None:
    suite = load_suite("sweep")
    assert suite.shared_anchors and len(suite.variants) >= 6
    specs = plan(suite, tmp_path, profile="quick")
    by_preset = {p: [s for s in specs if s.label.startswith(p)] for p in ("grpo", "pvpo")}
    assert {s.config.rollout.n for s in by_preset["grpo"]} == {8}
    assert {s.config.rollout.n for s in by_preset["pvpo"]} == {2}
    assert {s.config.pvpo.presample_seed for s in by_preset["pvpo"]} == {0}
    grid = {(s.config.optim.lr, s.config.kl.coef) for s in by_preset["pvpo"]}
    assert len(grid) == len(suite.variants)  # every configuration differs


def _records(total: float, presample: float = 0.0, sampled: float | None = None, s: float = 10.0):
    last = {"step": 2, "rollouts/cumulative": total - presample, "rollouts/total": total,
            "rollouts/presample": presample, "rollouts/refresh": 0.0, "time/elapsed": s}  # fmt: skip
    if sampled is not None:
        last["pvpo/anchors_sampled"] = sampled
    return [{"step": 0, "rollouts/total": presample, "time/elapsed": 1.0}, last]


def test_a_runs_own_cost_takes_out_the_anchors_it_read_from_the_store() -> None:
    first = run_cost(_records(5696, 4096, 4096), setup_s=9.5)
    later = run_cost(_records(5696, 4096, 0))
    assert first["rollouts"] == 5696 and later["rollouts"] == 1600
    assert later["total"] == 5696 and later["anchors"] == 4096  # what the anchors rest on
    assert first["wall_seconds"] == 19.5 and later["wall_seconds"] == 10.0
    assert first["measured"] and later["measured"]
    old = run_cost(_records(5696, 4096))  # logged before pvpo/anchors_sampled: counted in full
    assert old["rollouts"] == 5696 and not old["measured"]
    assert run_cost(_records(6400))["rollouts"] == 6400


@pytest.mark.parametrize(
    ("ours", "theirs", "k", "projected"),
    [
        ([5696, 1600, 1600], [6400] * 3, 1, 1),  # cheaper from the first run
        ([10000, 1600, 1600, 1600], [3000] * 4, None, 6),  # 10000 + 5*1600 = 18000 = 6*3000
        ([10000, 1600, 1600, 1600], [4000] * 4, 4, 4),  # 14800 <= 16000, 13200 > 12000
        ([10000, 3000, 3000], [3000] * 3, None, None),  # later runs cost as much: never
    ],
)
def test_break_even_is_the_first_k_at_or_below(ours, theirs, k, projected) -> None:
    assert break_even(ours, theirs) == k
    assert projected_break_even(ours, theirs) == projected


def test_break_even_counts_equal_cost_and_reports_whether_it_holds() -> None:
    assert break_even([4, 4], [4, 4]) == 1  # at or below
    assert holds_from([4, 4], [4, 4], 1)
    assert break_even([1, 9, 9], [2, 2, 2]) == 1 and not holds_from([1, 9, 9], [2, 2, 2], 1)
    assert break_even([5, 1], [4, 1, 1]) is None  # only the K runs both ran count


def test_sweep_summary_of_synthetic_runs() -> None:
    runs = [{"label": "grpo+a", "seed": 0, "reads_anchors": False, "records": _records(6400)},
            {"label": "grpo+b", "seed": 0, "reads_anchors": False, "records": _records(6400)},
            {"label": "pvpo+a", "seed": 0, "reads_anchors": True,
             "records": _records(9696, 8096, 8096)},
            {"label": "pvpo+b", "seed": 0, "reads_anchors": True,
             "records": _records(9696, 8096, 0)}]  # fmt: skip
    payload = sweep_summary(runs)
    pvpo = payload["methods"]["pvpo"]
    assert [r["rollouts"] for r in pvpo["runs"]] == [9696, 1600]
    assert pvpo["cumulative"]["rollouts"] == [9696, 11296]
    assert pvpo["per_run"]["rollouts"] == [9696, 5648]
    assert payload["methods"]["grpo"]["cumulative"]["rollouts"] == [6400, 12800]
    (pair,) = payload["break_even"]
    assert (pair["method"], pair["against"], pair["k_max"]) == ("pvpo", "grpo", 2)
    assert pair["rollouts"] == {"k": 2, "holds": True, "projected": 2}
    assert pair["wall_seconds"]["k"] == 1  # equal seconds: at or below
    text = sweep_markdown(json.loads(json.dumps(payload)))
    assert "## Sweep sharing one anchor store" in text
    assert "| `pvpo` vs `grpo` | 2 | 2 | 2 |" in text
    runs[3]["records"] = _records(9696, 8096, 8096)  # the store was not shared
    payload = sweep_summary(runs)
    assert payload["break_even"][0]["rollouts"]["k"] is None
    assert "none within K" in sweep_markdown(payload)


def test_the_anchors_sampled_count_survives_a_resume(monkeypatch) -> None:
    from anchor_rl.trainer.pvpo import PVPO

    def component(sampled_now: int) -> PVPO:
        pvpo = PVPO.__new__(PVPO)
        pvpo.pooled, pvpo.anchor_key = None, "key"
        pvpo.set = SimpleNamespace(result=SimpleNamespace(rollouts=sampled_now))
        pvpo.presample_rollouts, pvpo.refresh_rollouts = 16, 0
        pvpo.sampled_before = pvpo.refresh_sampled = 0
        pvpo.teacher_rollouts = 0
        return pvpo

    first = component(16)
    first.refresh_sampled = 4  # a refresh it sampled
    assert first.counters()["pvpo/anchors_sampled"] == 20
    assert "pvpo/anchors_sampled" not in {k for k in first.counters() if k.startswith("rollouts/")}
    resumed = component(0)  # the resumed process found its anchors in the store
    monkeypatch.setattr(resumed, "_use", lambda digest: None)
    resumed.load_state_dict(first.state_dict())
    assert resumed.anchors_sampled == 20


@pytest.mark.slow
def test_micro_sweep_end_to_end(tmp_path) -> None:
    out = tmp_path / "out"
    result = run_suite(_suite(tmp_path), BenchArgs(out, echo=lambda _: None))
    sweep = json.loads(result["summary_json"].read_text())["sweep"]
    pvpo, grpo = sweep["methods"]["pvpo"], sweep["methods"]["grpo"]
    assert pvpo["reads_anchors"] and not grpo["reads_anchors"]
    assert sweep["anchor_draws"] == 1
    first, second = pvpo["runs"]
    # the same anchors rest under both runs ...
    assert first["anchors"] == second["anchors"] > 0
    # ... the first sampled them, the second read them from the one store
    assert first["sampled"] == first["anchors"] and second["sampled"] == 0
    assert second["rollouts"] == 2 * 2 * 2  # steps x prompts x N: its policy rollouts
    assert (out / "anchors.db").is_file()
    assert [r["rollouts"] for r in grpo["runs"]] == [16, 16]
    pair = sweep["break_even"][0]
    assert pair["rollouts"]["k"] == break_even(
        [r["rollouts"] for r in pvpo["runs"]], [r["rollouts"] for r in grpo["runs"]]
    )
    assert set(sweep["accuracy"]) == {"lr1", "lr2"}
    assert "pvpo - grpo" in sweep["accuracy"]["lr1"]["diff"]
    assert "## Sweep sharing one anchor store" in result["summary_md"].read_text()
    from anchor_rl.bench.report import write_report

    page = write_report([out], tmp_path / "report")["md"].read_text()
    assert "Sweep sharing one anchor store" in page and "`pvpo` vs `grpo`" in page

    # scripts/sweep_vs_small_n.py pairs the PVPO runs with GRPO's by configuration and seed
    # (here GRPO N = 4 of the same sweep), at equal steps and at each k's cost per run
    script = Path(__file__).resolve().parents[2] / "scripts" / "sweep_vs_small_n.py"
    done = subprocess.run(
        [sys.executable, str(script), str(out), str(out), "--out", str(tmp_path / "vs.json")],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    vs = json.loads((tmp_path / "vs.json").read_text())
    assert json.loads(done.stdout) == vs
    assert vs["configurations"] == ["lr1/seed0", "lr2/seed0"]
    assert [row["k"] for row in vs["equal_cost_per_run"]] == [1, 2]
    per_run = [round(c) for c in pvpo["per_run"]["rollouts"]]
    assert [row["pvpo_per_run"] for row in vs["equal_cost_per_run"]] == per_run
    for reading in [vs["equal_steps"], *vs["equal_cost_per_run"]]:
        assert reading["low"] <= reading["diff"] <= reading["high"]


def test_bench_cli_switches_a_suite_file_to_a_sweep_and_back(tmp_path, monkeypatch) -> None:
    from typer.testing import CliRunner

    import anchor_rl.bench.runner as runner
    from anchor_rl.cli import app

    seen = []

    def fake_run_suite(suite, args):
        seen.append(suite.shared_anchors)
        (args.out).mkdir(parents=True, exist_ok=True)
        (args.out / "summary.md").write_text("ok\n")
        return {"summary_json": args.out / "summary.json", "summary_md": args.out / "summary.md",
                "plots": []}  # fmt: skip

    monkeypatch.setattr(runner, "run_suite", fake_run_suite)
    out = ["--out", str(tmp_path / "o")]
    for flags in ([], ["--own-anchors"], ["--shared-anchors"]):
        name = "sweep" if flags != ["--shared-anchors"] else "pvpo"
        result = CliRunner().invoke(app, ["bench", name, *flags, *out])
        assert result.exit_code == 0, result.output
    assert seen == [True, False, True]
    refused = CliRunner().invoke(app, ["bench", "trl", "--shared-anchors", *out])
    assert refused.exit_code == 2 and "--shared-anchors" in refused.output, refused.output
