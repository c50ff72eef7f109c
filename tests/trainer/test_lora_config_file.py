"""``lora.config_file`` is read once, when the run starts: the run keeps the PEFT config it
read (RUN_DIR/lora_config.json), and its resumes use that copy, so a moved or edited file
neither breaks nor silently changes them; a different file on the resume's command line is
refused."""

from __future__ import annotations

import json

import pytest

from anchor_rl.errors import ConfigError
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import resume_run, resumed_config, start_run


def _write(path, rank: int):
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": "all-linear"}
    path.write_text(json.dumps(config))
    return path


def _rank(run) -> int:
    return run.policy.peft_config["default"].r


def test_a_resume_uses_the_stored_config_when_the_file_moved(parity, tiny, tmp_path) -> None:
    file = _write(tmp_path / "adapter.json", 4)
    overrides = [*tiny, f"lora.config_file={file}", "optim.lr=1e-2", "checkpoint.every=2"]
    run = train(start_run(load_config("grpo", [*overrides, "steps=2"]), tmp_path / "run"))
    stored = json.loads((run.run_dir / "lora_config.json").read_text())
    assert stored == json.loads(file.read_text()) and _rank(run) == 4
    file.rename(tmp_path / "moved.json")
    resumed = train(resume_run(run.run_dir, {"steps": 3}))
    assert resumed.state.step == 3 and _rank(resumed) == 4
    stored_cfg = json.loads((run.run_dir / "config.json").read_text())
    assert stored_cfg["lora"]["config_file"] == str(file)  # the run's record is unchanged


def test_an_edited_file_does_not_change_a_run_restarted_before_its_checkpoint(
    parity, tiny, tmp_path
) -> None:
    file = _write(tmp_path / "adapter.json", 4)
    cfg = load_config("grpo", [*tiny, f"lora.config_file={file}", "steps=2"])
    start_run(cfg, tmp_path / "run").close()  # set up, stopped before any checkpoint
    _write(file, 8)
    restarted = resume_run(tmp_path / "run")
    assert _rank(restarted) == 4
    restarted.close()


def test_a_config_file_on_the_resume_command_line_must_be_the_stored_one(
    parity, tiny, tmp_path
) -> None:
    file = _write(tmp_path / "adapter.json", 4)
    start_run(load_config("grpo", [*tiny, f"lora.config_file={file}"]), tmp_path / "run").close()
    same = tmp_path / "elsewhere.json"
    same.write_text(file.read_text())
    assert (
        resumed_config(tmp_path / "run", {"lora.config_file": str(same)}).lora.file_config["r"] == 4
    )
    other = _write(tmp_path / "other.json", 8)
    with pytest.raises(
        ConfigError, match=r"differs from the LoRA config this run started with.*r: 4 -> 8"
    ):
        resumed_config(tmp_path / "run", {"lora.config_file": str(other)})
