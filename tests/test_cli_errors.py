"""Every failure a user can cause ends the ``anchor-rl`` command on one screen: a message that
names the cause and the fix, exit code 2, and no traceback unless ``--debug`` asks for it.
An unexpected error exits 1 and says how to see the traceback.

Most cases run the command line's app in this process (``typer.testing.CliRunner``: the same
command group and its error handling, without a new interpreter's imports); the cases that
import a plug-in, which would register its names in this process, and the ones about the
console entry point itself run the real command in a subprocess, side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import TINY

PLUGIN_IMPORT_FAILS = 'raise RuntimeError("boom in plugin")\n'

PLUGIN_ESTIMATOR_FAILS = """
from anchor_rl.algos.advantages import register_advantage

@register_advantage("explodes", inputs=("rewards", "index"))
def explodes(rewards, index):
    raise RuntimeError("an estimator bug")
"""


@dataclass(frozen=True)
class Case:
    args: tuple[str, ...]
    code: int
    message: str  # in the first line of stderr
    env: tuple[tuple[str, str], ...] = ()
    subprocess: bool = False  # a plug-in: keep its registrations out of this process


@dataclass(frozen=True)
class Done:
    returncode: int
    stderr: str


def _run_here(args: tuple[str, ...], cwd: Path, env: dict[str, str]) -> Done:
    """The ``anchor-rl`` app on ``args`` in this process, in ``cwd``, with ``env`` set."""
    from typer.testing import CliRunner

    from anchor_rl.cli import app

    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(cwd)
        mp.delenv("ANCHOR_RL_DEBUG", raising=False)
        result = CliRunner().invoke(app, list(args), env=env)
    return Done(result.exit_code, result.stderr)


def _run(args: tuple[str, ...], cwd: Path, env: dict[str, str] | None = None):
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    full_env.pop("ANCHOR_RL_DEBUG", None)
    return subprocess.run(
        [sys.executable, "-m", "anchor_rl.cli", *args],
        cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _write_files(root: Path) -> None:
    (root / "no_question.jsonl").write_text(json.dumps({"q": "1+1", "answer": "2"}) + "\n")
    (root / "torn.jsonl").write_text('{"question": "1+1", "answer": "2"}\n{"question": \n')
    (root / "import_fails.py").write_text(PLUGIN_IMPORT_FAILS)
    (root / "estimator_fails.py").write_text(PLUGIN_ESTIMATOR_FAILS)
    (root / "empty").mkdir()
    (root / "not_a_store.db").write_text("these are notes, not an SQLite database\n" * 20)
    (root / "torn_run").mkdir()
    (root / "torn_run" / "config.json").write_text('{"task": "arith')


def _file_task(path: str) -> str:
    return json.dumps({"path": path, "format": None, "question": "question", "answer": "answer"})


CASES = {
    "missing model directory": Case(
        ("train", "model=does/not/exist", "steps=1"),
        2, "model 'does/not/exist' is neither a model directory",
    ),
    "unknown task": Case(("train", "task=gsm9k", "steps=1"), 2, "unknown task 'gsm9k'"),
    "a section's key without its section": Case(
        ("train", "lr=1e-4"), 2, "unknown config key 'lr' (did you mean optim.lr, critic.lr?)"
    ),
    "task argument of the wrong type": Case(
        ("train", "task_args.n_train=many", "steps=1"), 2, "task_args.n_train='many'"
    ),
    "task argument the task does not take": Case(
        ("train", "task_args.digits=3", "steps=1"), 2, "got unknown argument(s) ['digits']"
    ),
    "unknown preset": Case(("train", "-p", "grpoo"), 2, "unknown preset 'grpoo'"),
    "unknown engine": Case(
        ("train", "rollout.engine=vllm", "steps=1"), 2, "invalid config:"
    ),
    "a GPU asked for and none visible": Case(
        ("train", "device=cuda", "steps=1"), 2, "device=cuda but no CUDA GPU is visible",
        env=(("CUDA_VISIBLE_DEVICES", ""),),
    ),
    "dataset row without the question column": Case(
        ("eval", "--model", "random:tiny", "--task", "file",
         "--task-kwargs", _file_task("no_question.jsonl")),
        2, "no_question.jsonl row 0: no field 'question' (fields: answer, q)",
    ),
    "dataset file with a torn line": Case(
        ("eval", "--model", "random:tiny", "--task", "file", "--task-kwargs", _file_task("torn.jsonl")),
        2, "torn.jsonl:2: not valid JSON",
    ),
    "missing dataset file": Case(
        ("eval", "--model", "random:tiny", "--task", "file", "--task-kwargs", _file_task("nope.jsonl")),
        2, "no such dataset file: nope.jsonl",
    ),
    "a server that is not running": Case(
        ("eval", "--model", "http:http://127.0.0.1:9/v1", "--task", "arithmetic", "--limit", "1"),
        2, "cannot reach http://127.0.0.1:9/v1/tokenizer",
    ),
    "anchor keys of a file that is no store": Case(
        ("anchors", "keys", "not_a_store.db"), 2, "not_a_store.db is not an anchor store",
    ),
    "a preset given as an override": Case(
        ("train", "preset=dapo", "steps=1"), 2, "start from a preset with --preset dapo",
    ),
    "report of a directory with no results": Case(("report", "empty"), 2, "no results under empty"),
    "unknown bench suite": Case(("bench", "baslines"), 2, "unknown suite 'baslines'"),
    "unknown bench suite, the function suites listed": Case(
        ("bench", "nope"), 2, "throughput, trl, trl-pvpo"
    ),
    "a preset file that does not exist": Case(
        ("train", "-p", "missing.toml"), 2, "preset file missing.toml does not exist"
    ),
    "a device torch does not know": Case(
        ("eval", "--model", "random:tiny", "--task", "arithmetic", "--device", "banana"),
        2, "device='banana' is not a torch device",
    ),
    "an sft: reference on a task with too few training records": Case(
        ("train", "task_args.n_train=5", "steps=1"),
        2, "model=sft:tiny: the SFT of task 'arithmetic' stops by its accuracy classes",
    ),
    "resume a run whose config.json is torn": Case(
        ("train", "--resume", "torn_run"), 2, "config.json is not a run's config"
    ),
    "resume a directory that holds no run": Case(
        ("train", "--resume", "empty"), 2, "holds no run"
    ),
    "a plug-in that fails to import": Case(
        ("train", "plugins=[\"import_fails.py\"]", "steps=1"),
        2, "plugin 'import_fails.py' raised RuntimeError: boom in plugin at import_fails.py:1",
        subprocess=True,
    ),
    "an unexpected error inside the loop": Case(
        ("train", "plugins=[\"estimator_fails.py\"]", "advantage.estimator=explodes",
         "steps=1", *TINY),
        1, "RuntimeError: an estimator bug", subprocess=True,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    _write_files(root)
    apart = {name: c for name, c in CASES.items() if c.subprocess}
    with ThreadPoolExecutor(max_workers=len(apart)) as pool:
        futures = {name: pool.submit(_run, c.args, root, dict(c.env)) for name, c in apart.items()}
        here = {
            name: _run_here(c.args, root, dict(c.env))
            for name, c in CASES.items()
            if not c.subprocess
        }
        return here | {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_a_user_error_ends_on_one_screen(results, name) -> None:
    case, done = CASES[name], results[name]
    assert done.returncode == case.code, done.stderr
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("error: ") and case.message in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert len(lines) <= 3  # the message, and for an unexpected error the --debug hint
    if case.code == 1:
        assert "--debug" in done.stderr


MODEL_COMMANDS = ("eval", "presample", "serve")


@pytest.mark.parametrize("command", MODEL_COMMANDS)
def test_a_missing_model_is_a_usage_error_on_every_command(tmp_path, command) -> None:
    done = _run_here((command, "--model", "does/not/exist", "--task", "arithmetic"), tmp_path,
                     {"COLUMNS": "300"})  # fmt: skip
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "Invalid value for --model" in done.stderr and "neither a model directory" in done.stderr


EVAL_USAGE_ERRORS = {
    "a task argument out of range": (
        ("--task-kwargs", '{"levels": [[9, 9]]}'), "Invalid value for --task: level (9, 9)"),
    "top_p = 0": (("--top-p", "0", "--max-new-tokens", "8"), "top_p must be in (0, 1]"),
    "a negative limit": (("--limit", "-2"), "Invalid value for '--limit'"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(EVAL_USAGE_ERRORS))
def test_bad_eval_options_are_usage_errors(tmp_path, name) -> None:
    """Not an 'unexpected error' (exit 1) nor a silent reading (--limit -2 once dropped the
    last two records)."""
    extra, message = EVAL_USAGE_ERRORS[name]
    args = ("eval", "--model", "random:tiny", "--task", "arithmetic", *extra)
    done = _run_here(args, tmp_path, {"COLUMNS": "300"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr, done.stderr


OUTPUT_USAGE_ERRORS = {
    "eval --out an existing directory": (
        ("eval", "--model", "random:tiny", "--task", "arithmetic", "--out", "."),
        "Invalid value for --out: . is a directory"),
    "presample --export of a format it cannot write": (
        ("presample", "--model", "random:tiny", "--task", "arithmetic", "--export", "a.csv"),
        "a.csv must end in .jsonl or .parquet"),
    "presample --db a directory": (
        ("presample", "--model", "random:tiny", "--task", "arithmetic", "--db", "."),
        "Invalid value for --db: . is a directory"),
    "eval --model a bare URL": (
        ("eval", "--model", "http://127.0.0.1:1/v1", "--task", "arithmetic"),
        "write http:http://127.0.0.1:1/v1"),
    "presample --model a bare URL": (
        ("presample", "--model", "http://127.0.0.1:1/v1", "--task", "arithmetic"),
        "write http:http://127.0.0.1:1/v1"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(OUTPUT_USAGE_ERRORS))
def test_bad_paths_and_urls_are_usage_errors_before_any_work(tmp_path, name) -> None:
    """Found before the model is loaded or anything sampled, not after the work."""
    args, message = OUTPUT_USAGE_ERRORS[name]
    done = _run_here(args, tmp_path, {"COLUMNS": "300"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert message in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_an_anchor_store_that_cannot_be_opened_names_the_path(tmp_path) -> None:
    from anchor_rl.anchors.store import AnchorStore
    from anchor_rl.errors import AnchorRLError

    with pytest.raises(AnchorRLError, match=f"{tmp_path} is a directory, not an anchor store"):
        AnchorStore(tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(AnchorRLError, match="cannot open the anchor store .*file/anchors.db"):
        AnchorStore(tmp_path / "file" / "anchors.db")


def test_debug_shows_the_traceback(tmp_path) -> None:
    (tmp_path / "import_fails.py").write_text(PLUGIN_IMPORT_FAILS)
    done = _run(("train", 'plugins=["import_fails.py"]', "steps=1", "--debug"), tmp_path)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and "boom in plugin" in done.stderr


def test_a_finished_run_says_how_to_resume_and_a_corrupt_checkpoint_offers_the_previous(
    tmp_path,
) -> None:
    run = ("train", *TINY, "eval.every=0", "checkpoint.every=1", "checkpoint.keep=2", "steps=2",
           "--out", "run")  # fmt: skip
    first = _run_here(run, tmp_path, {})
    assert first.returncode == 0, first.stderr
    again = _run_here(run, tmp_path, {})
    assert again.returncode == 2
    assert "continue it with anchor-rl train --resume" in again.stderr
    changed = _run_here(("train", "--resume", "run", "steps=3", "rollout.n=2"), tmp_path, {})
    assert changed.returncode == 2
    assert "'rollout.n' cannot change on resume" in changed.stderr
    (tmp_path / "run" / "checkpoints" / "step_000002" / "optimizer.pt").write_bytes(b"torn")
    resumed = _run_here(("train", "--resume", "run", "steps=3"), tmp_path, {})
    assert resumed.returncode == 2 and "Traceback" not in resumed.stderr
    assert "step_000002" in resumed.stderr and "--from step_000001" in resumed.stderr


def test_an_unknown_key_suggests_the_full_paths_of_its_name(tmp_path) -> None:
    from anchor_rl.errors import ConfigError
    from anchor_rl.trainer.config import field_paths, load_config
    from anchor_rl.trainer.presets import suggest_keys

    known = list(field_paths())
    assert suggest_keys("n", known) == ["rollout.n"]
    assert suggest_keys("temprature", known)[:2] == ["rollout.temperature", "eval.temperature"]
    assert suggest_keys("optm.lr", known)[0] == "optim.lr"
    assert suggest_keys("kl.coeff", known)[0] == "kl.coef"
    assert suggest_keys("zzz", known) == []
    (tmp_path / "mine.toml").write_text("lr = 1e-4\n")  # a preset file: the same hint
    with pytest.raises(
        ConfigError, match=r"lr: unknown key \(did you mean optim.lr, critic.lr\?\)"
    ):
        load_config(str(tmp_path / "mine.toml"))


@pytest.mark.parametrize("out", [(), ("--out", "run")])
def test_a_set_up_that_fails_leaves_no_run_directory(tmp_path, out) -> None:
    """A model that cannot load fails before anything is written: no empty ``runs/...``."""
    done = _run_here(("train", "model=does/not/exist", "steps=1", *out), tmp_path, {})
    assert done.returncode == 2 and "neither a model directory" in done.stderr, done.stderr
    assert list(tmp_path.iterdir()) == []


def _commands() -> dict[tuple[str, ...], str]:
    """The docstring (or ``help=``) of ``anchor-rl`` and of every command and group under it,
    by the words that call it."""
    import inspect

    from anchor_rl.cli import app

    def walk(group, path):
        for info in group.registered_commands:
            yield (*path, info.name), info.help or inspect.getdoc(info.callback)
        for info in group.registered_groups:
            sub = info.typer_instance
            yield (*path, info.name), info.help or sub.info.help
            yield from walk(sub, (*path, info.name))

    return {(): inspect.getdoc(app.registered_callback.callback), **dict(walk(app, ()))}


COMMANDS = _commands()


@pytest.mark.parametrize("path", list(COMMANDS), ids=lambda p: " ".join(p) or "anchor-rl")
def test_no_help_breaks_mid_sentence(tmp_path, path) -> None:
    """On a terminal wide enough for any paragraph, each paragraph of a command's help (and
    the first of each sub-command's, in the command list) is on one line: the docstring's own
    line breaks, which fall mid-sentence at any other width, are not kept."""
    from typer.testing import CliRunner

    from anchor_rl.cli import app

    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "1000"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    wanted = [p for p in COMMANDS[path].split("\n\n")]
    wanted += [doc.split("\n\n")[0] for sub, doc in COMMANDS.items() if sub[:-1] == path and sub]
    for paragraph in wanted:
        text = " ".join(paragraph.split())
        assert any(text in line for line in lines), f"{text!r} is broken across lines:\n" + (
            result.output
        )
