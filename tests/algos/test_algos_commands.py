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
