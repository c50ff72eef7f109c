"""docs/training.md, "Extending": the example plug-in file runs, and each command after it
trains with what it registers (in a subprocess, as a user would: the registrations stay
out of this test process). docs/results.md's table of contents lists its sections, and the
links of it and of its details pages resolve."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

DOC = Path(__file__).parents[1] / "docs" / "training.md"
FAST = [
    "model=random:tiny", "train_prompts=4", "steps=2", "rollout.prompts_per_step=2",
    "rollout.n=2", "rollout.max_new_tokens=8", "eval.every=0", "log.progress=false",
    "log.tensorboard=false",
]  # fmt: skip


def _section() -> str:
    text = DOC.read_text()
    return text.split("## Extending", 1)[1].split("\n## ", 1)[0]


def _blocks(kind: str) -> list[str]:
    return re.findall(rf"```{kind}\n(.*?)```", _section(), re.DOTALL)


def _commands() -> list[list[str]]:
    commands = []
    for block in _blocks("bash"):
        line = " ".join(part.strip() for part in block.replace("\\\n", " ").splitlines())
        args = line.split()
        assert args[:2] == ["anchor-rl", "train"], line
        commands.append([arg.strip("'") for arg in args[2:]])
    return commands


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory) -> Path:
    """The section's Python blocks, in order, as the file the commands name."""
    blocks = _blocks("python")
    assert len(blocks) == 3 and blocks[0].startswith("# my_methods.py")
    folder = tmp_path_factory.mktemp("plugin")
    (folder / "my_methods.py").write_text("\n".join(blocks))
    return folder


def _train(folder: Path, args: list[str], out: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "anchor_rl.cli", "train", *args, *FAST, "--out", str(out)]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=300)


def test_the_section_has_an_estimator_a_method_and_an_engine() -> None:
    commands = [" ".join(c) for c in _commands()]
    assert any("advantage.estimator=median" in c for c in commands)
    assert any("components=running_mean" in c for c in commands)
    assert any("rollout.engine=counting" in c for c in commands)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(3))
def test_each_command_trains_with_the_plugin(plugin_dir, index, tmp_path) -> None:
    args = _commands()[index]
    out = tmp_path / "run"
    done = _train(plugin_dir, args, out)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    config = json.loads((out / "config.json").read_text())
    assert config["plugins"] == ["my_methods.py"]
    checkpoint = next((out / "checkpoints").iterdir())
    if "components=running_mean" in args:
        assert config["components"] == ["running_mean"]
        assert config["component_args"] == {"running_mean": {"decay": 0.8}}
        import torch

        state = torch.load(checkpoint / "running_mean.pt", weights_only=True)
        assert len(state["means"]) >= 1  # it learned the prompts it saw
    if "rollout.engine=counting" in args:
        assert config["rollout"]["engine"] == "counting"
    if index:
        return
    # a resumed run imports the plug-in again (once: the import is the same for every command)
    resumed = subprocess.run(
        [sys.executable, "-m", "anchor_rl.cli", "train", "--resume", str(out), "steps=3"],
        cwd=plugin_dir, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]


@pytest.mark.slow
def test_the_engine_counts_every_response_it_samples(plugin_dir, tmp_path) -> None:
    script = f"""
import json, sys
from anchor_rl.trainer.config import load_config
from anchor_rl.trainer.loop import train
from anchor_rl.trainer.run import start_run
cfg = load_config("grpo", {json.dumps(["plugins=my_methods.py", "rollout.engine=counting", *FAST])})
run = train(start_run(cfg, {str(tmp_path / "run")!r}))
print(json.dumps({{"sampled": run.engine.sampled, "rollouts": run.state.rollouts}}))
"""
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=plugin_dir, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    assert counts["sampled"] == counts["rollouts"] == 2 * 2 * 2


RESULTS = DOC.parent / "results.md"
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _headings(text: str, level: int | None = None) -> list[str]:
    """The headings of a markdown page outside code blocks (only those of ``level`` if given)."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    found = [re.match(r"(#{1,6}) (.*)", line) for line in text.splitlines()]
    return [m[2].strip() for m in found if m and level in (None, len(m[1]))]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in _headings(page.read_text())}


def test_results_md_contents_list_every_section_and_link_to_it() -> None:
    """Every ``##`` heading of docs/results.md (outside code blocks) is in the contents at its
    top, in order, linked by GitHub's anchor for it; the page stays an answer page, short."""
    text = RESULTS.read_text()
    contents, body = text.split("\n**Contents.**", 1)[1].split("\n## ", 1)
    headings = _headings("## " + body, level=2)
    links = re.findall(r"^- \[(.*)\]\(#(.*)\)$", contents, re.MULTILINE)
    assert links == [(h, _anchor(h)) for h in headings]
    assert len(text.splitlines()) < 300, "details belong on the suites' pages under docs/results/"


def test_results_pages_links_resolve() -> None:
    """Every relative link of docs/results.md and of its details pages (docs/results/*.md,
    docs/results/*/README.md) names a file that exists and, for a markdown file, a heading
    of it."""
    pages = [RESULTS, *sorted((DOC.parent / "results").glob("*.md"))]
    pages += sorted((DOC.parent / "results").glob("*/README.md"))
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, fragment = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists() or (
                fragment and file.suffix == ".md" and fragment not in _anchors(file)
            ):
                broken.append(f"{page.relative_to(DOC.parent)}: {target}")
    assert len(pages) > 10
    assert not broken, broken
