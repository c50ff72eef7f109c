"""Sampling through `anchor-rl serve` from the commands and the trainer: presampling stores the
in-process anchors, evaluation reports the in-process metrics, and a seeded GRPO run whose
rollouts come from the server (weights synced through the reload endpoint after every
update) logs the in-process run's metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY, metrics_but_timings
from typer.testing import CliRunner

from anchor_rl.anchors.store import AnchorStore
from anchor_rl.cli import app
from anchor_rl.models.factory import build_model
from anchor_rl.models.tokenizer import build_tokenizer
from anchor_rl.serve.app import ServerThread, build_app
from anchor_rl.serve.model import ModelServer
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.logging import read_metrics
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run

runner = CliRunner()


def invoke(*args: str) -> str:
    result = runner.invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    return result.output


def _rows(db: Path) -> list[dict]:
    with AnchorStore(db) as store:
        return [
            {k: v for k, v in row.items() if k not in ("created", "updated")}
            for row in store.rows("stats")
        ]


def test_presample_through_the_server_stores_the_in_process_anchors(
    served, tiny_dir, tmp_path
) -> None:
    """anchor-rl serve reports the content fingerprint of its weights, so the key, the
    seeds and therefore the stored rows are those of an in-process presample."""
    common = [
        "--task",
        "arithmetic",
        "--m",
        "3",
        "--limit",
        "5",
        "--max-new-tokens",
        "24",
        "--seed",
        "3",
    ]
    invoke("presample", "--model", tiny_dir, *common, "--db", tmp_path / "local.db")
    invoke(
        "presample", "--model", f"http:{served[0].url}/v1", *common, "--db", tmp_path / "served.db"
    )
    local, remote = _rows(tmp_path / "local.db"), _rows(tmp_path / "served.db")
    assert len(local) == 5 and all(r["n"] == 3 for r in local)
    assert remote == local


def test_eval_takes_a_served_model_or_a_built_in_spec(
    served, tiny_dir, tmp_path, monkeypatch
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # eval sets torch's thread count from it
    common = [
        "--task",
        "arithmetic",
        "--k",
        "2",
        "--limit",
        "4",
        "--max-new-tokens",
        "24",
        "--seed",
        "0",
    ]
    results = {}
    for name, model in [
        ("dir", tiny_dir),
        ("http", f"http:{served[0].url}#tiny"),
        ("random", "random:tiny"),  # --seed 0 inits it as tiny_dir was
    ]:
        out = tmp_path / f"{name}.json"
        invoke("eval", "--model", model, *common, "--out", out)
        results[name] = json.loads(out.read_text())
    assert results["http"]["server"]["model"] == "tiny"  # and the weights' fingerprint
    strip = {"model", "server"}
    dir_result = {k: v for k, v in results["dir"].items() if k not in strip}
    assert dir_result["samples"] == 8
    assert {k: v for k, v in results["http"].items() if k not in strip} == dir_result
    assert {k: v for k, v in results["random"].items() if k not in strip} == dir_result


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["serve", "--model", "random:huge"], "unknown size 'huge'"),
        (["eval", "--model", "no/such/dir", "--task", "arithmetic"], "neither a model directory"),
        (["presample", "--model", "http:ftp://x", "--limit", "1"], "not an http(s) URL"),
    ],
)
def test_the_commands_refuse_what_they_cannot_load(args, message) -> None:
    result = runner.invoke(app, args)
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_serve_prints_the_port_it_bound(monkeypatch) -> None:
    """``--port 0`` announces the free port it got, once the socket listens (the server
    stops at once here: its main loop is a no-op)."""
    import re

    import uvicorn

    async def no_loop(self) -> None:
        return None

    monkeypatch.setattr(uvicorn.Server, "main_loop", no_loop)
    monkeypatch.setattr("anchor_rl.cli.options.default_threads", lambda: torch.get_num_threads())
    output = invoke("serve", "--model", "random:tiny", "--port", "0", "--log-level", "warning")
    port = re.search(r"serving 'random:tiny' on http://127\.0\.0\.1:(\d+)/v1", output)
    assert port is not None and int(port.group(1)) > 0, output


# -- training through the server ----------------------------------------------------------

_TINY = [*TINY, "steps=3", "optim.lr=1e-3"]


@pytest.mark.slow
def test_a_seeded_grpo_run_through_the_server_logs_the_in_process_metrics(
    parity, tmp_path, one_thread
) -> None:
    tokenizer = build_tokenizer()
    other = build_model("tiny", tokenizer, seed=5)  # not the run's initial weights
    server = ModelServer(other, tokenizer, "tiny")
    local = train(start_run(load_config("grpo", _TINY), tmp_path / "hf"))
    with ServerThread(build_app(server)) as thread:
        overrides = [
            *_TINY, "rollout.engine=http",
            f"rollout.engine_args.url={thread.url}/v1",
        ]  # fmt: skip
        remote = start_run(load_config("grpo", overrides), tmp_path / "http")
        assert type(remote.engine).__name__ == "HTTPEngine"
        remote = train(remote)
    assert metrics_but_timings(local.run_dir) == metrics_but_timings(remote.run_dir)
    assert any(r.get("grad_norm", 0) > 0 for r in read_metrics(local.run_dir))  # real updates
    assert remote.engine.syncs == 1 + 3  # the initial weights, then after every update
    assert server.rows >= 3 * 8  # every step's 2 x 4 rollouts (and the evaluations) were served
    for key, value in local.policy.state_dict().items():
        assert torch.equal(value, remote.policy.state_dict()[key]), key
