"""The package's import structure: no import circle, and no import from a lower layer to a
higher one (docs/training.md, "Layers"). Every import counts, also one inside a function
or under ``TYPE_CHECKING``: a lazy import is still a dependency."""

from __future__ import annotations

import ast
from pathlib import Path

import anchor_rl

ROOT = Path(anchor_rl.__file__).parent

LAYERS = [
    {
        "batch",
        "errors",
        "registry",
        "progress",
        "allocator",
        "paths",
        "section",
        "algos",
        "interrupt",
        "threads",
    },
    {"rewards"},
    {"tools"},
    {"tasks"},
    {"models"},
    {"rollout"},
    {"anchors", "serve"},
    {"methods"},
    {"cluster", "trainer"},
    {"integrations"},
    {"bench"},
    {"cli"},
]
"""Bottom first: a module may import its own layer and the ones below."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in modules}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            subs = {f"{base}.{a.name}" for a in node.names} & modules
            found |= subs or ({base} & modules)
    return found - {name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, set(modules)) for name, path in modules.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the top-level package (version only)
    return next(i for i, layer in enumerate(LAYERS) if parts[1] in layer)


def test_every_module_has_a_layer() -> None:
    unplaced = [m for m in _graph() if m != "anchor_rl" and _layer(m) is None]
    assert unplaced == []


def test_no_import_goes_up_a_layer() -> None:
    upward = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if module != "anchor_rl" and _layer(target) > _layer(module)
    ]
    assert upward == []


def test_no_import_circle() -> None:
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_the_checker_sees_lazy_and_type_only_imports(tmp_path) -> None:
    path = tmp_path / "mod.py"
    path.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from anchor_rl.trainer import config\n"
        "def f():\n    from anchor_rl.bench import runner\n"
        "from anchor_rl.rollout.types import SamplingParams\n"
    )
    modules = set(_modules())
    assert _imports("anchor_rl.models.x", path, modules) == {
        "anchor_rl.trainer.config",
        "anchor_rl.bench.runner",
        "anchor_rl.rollout.types",
    }


def test_only_the_command_line_imports_the_command_line() -> None:
    cli = LAYERS.index({"cli"})
    importers = [
        f"{module} -> {target}"
        for module, targets in _graph().items()
        for target in targets
        if _layer(target) == cli and _layer(module) != cli
    ]
    assert importers == []


def test_only_the_command_line_defines_commands() -> None:
    """Command-line code (typer) lives in ``anchor_rl.cli``, not beside the code it drives."""
    users = [
        name
        for name, path in _modules().items()
        if _layer(name) != LAYERS.index({"cli"}) and "typer" in _top_level_imports(path)
    ]
    assert users == []


def _top_level_imports(path: Path) -> set[str]:
    """The top-level names of what ``path`` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.partition(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found.add((node.module or "").partition(".")[0])
    return found
