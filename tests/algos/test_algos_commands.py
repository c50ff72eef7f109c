"""`anchor-rl algos-check` runs every method on a synthetic batch."""

import json

from typer.testing import CliRunner

from anchor_rl.algos import losses, registry
from anchor_rl.cli import app


def test_algos_check_prints_every_method(tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["algos-check", "--seed", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    names = [*registry.ESTIMATORS, "gae_length_adaptive", *losses.AGG_MODES]
    names += [f"kl_{kind}" for kind in losses.KL_KINDS]
    for name in [*names, "clipfrac_low", "clipfrac_high", "baseline", "rejected", "extra"]:
        assert name in result.output, name
    data = json.loads(out.read_text())
    assert data["seed"] == 3
    assert set(data["advantages"]) == {*registry.ESTIMATORS, "gae_length_adaptive"}
    assert all(len(v) == 16 for v in data["advantages"].values())
    assert set(data["losses"]) == set(losses.AGG_MODES)
    assert all(len(v) == 4 for v in data["v05"].values())


def test_algos_check_ends_with_its_verdict(tmp_path):
    out = tmp_path / "check.json"
    result = CliRunner().invoke(app, ["algos-check", "--out", str(out)])
    assert result.exit_code == 0, result.output
    checks = json.loads(out.read_text())["checks"]
    assert len(checks) > 20 and all(failure is None for failure in checks.values()), checks
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"algos-check: all {len(checks)} checks passed"), last


def test_algos_check_names_what_failed_and_exits_1(monkeypatch):
    from anchor_rl.algos.advantages import Estimator

    def backwards(rewards, index):
        return -rewards  # ranks the worse response above the better

    def raises(rewards):
        raise RuntimeError("an estimator bug")

    monkeypatch.setitem(
        registry.ESTIMATORS, "backwards", Estimator(backwards, ("rewards", "index"))
    )
    monkeypatch.setitem(registry.ESTIMATORS, "raises", Estimator(raises, ("rewards",)))
    result = CliRunner().invoke(app, ["algos-check"])
    assert result.exit_code == 1, result.output
    last = result.output.strip().splitlines()[-1]
    # seed 0's first prompt has four correct responses: -rewards gives them -1, not 0
    assert last.startswith("algos-check: 3 of ") and "checks FAILED" in last, last
    assert "backwards ranks a prompt's responses by reward" in last
    assert "backwards gives 0 to a group of equal rewards" in last
    assert "raises runs" in last
    assert "FAILED raises runs: RuntimeError: an estimator bug" in result.output
