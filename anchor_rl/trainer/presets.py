"""Preset files (``anchor_rl/trainer/presets/NAME.toml`` or any TOML file) and ``key=value``
override parsing."""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from anchor_rl.errors import ConfigError


def builtin_names(package: str, folder: str) -> list[str]:
    """Names of the built-in TOML files in ``package``/``folder`` (presets, suites)."""
    files = resources.files(package) / folder
    return sorted(p.name.removesuffix(".toml") for p in files.iterdir() if p.name.endswith(".toml"))


def read_builtin_toml(
    kind: str, package: str, folder: str, name_or_path: str, others: Sequence[str] = ()
) -> tuple[dict[str, Any], str]:
    """``(table, name)`` of a built-in ``kind`` (``preset``, ``suite``) by name, or of a TOML
    file by path; ConfigError naming the built-in ones (with ``others``, the names the
    command takes besides its files) or the TOML error. A path (a name ending in ``.toml``
    or holding a directory) that names no TOML file is reported as such, not as a name."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.is_file():
        text, name = path.read_text(), path.stem
    elif path.suffix == ".toml" or len(path.parts) > 1:  # a path, not a name
        what = (
            "does not exist" if not path.exists()
            else "is a directory" if path.is_dir() else "does not end in .toml"
        )  # fmt: skip
        raise ConfigError(f"{kind} file {name_or_path} {what}; give the path of a .toml file")
    else:
        file = resources.files(package) / folder / f"{name_or_path}.toml"
        if not file.is_file():
            names = sorted({*builtin_names(package, folder), *others})
            raise ConfigError(
                f"unknown {kind} {name_or_path!r}; built-in {kind}s: "
                f"{', '.join(names)} (or pass a path to a .toml file)"
            )
        text, name = file.read_text(), name_or_path
    try:
        return tomllib.loads(text), name
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{kind} {name_or_path!r} is not valid TOML: {e}") from e


def preset_names() -> list[str]:
    """Names of the built-in presets."""
    return builtin_names("anchor_rl.trainer", "presets")


def read_preset(name_or_path: str) -> dict[str, Any]:
    """The raw table of a built-in preset name or a TOML file path, with `preset` set."""
    table, name = read_builtin_toml("preset", "anchor_rl.trainer", "presets", name_or_path)
    table.setdefault("preset", name)
    return table


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``key=value`` into the dotted key and a typed value.

    The value is read as a TOML value when it is one (``8``, ``0.04``, ``true``, ``"a b"``,
    ``[0.9, 0.99]``), ``none``/``null`` gives None, and anything else is kept as a string
    (``model=sft:tiny``). The config's field types then coerce and check it.
    """
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"override {text!r} is not of the form key=value")
    if raw.lower() in {"none", "null"}:
        return key, None
    try:
        return key, tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return key, raw


def suggest_keys(key: str, known: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` dotted keys of ``known`` that an unknown ``key`` may have meant: first every
    key whose last part is ``key``'s last part (``lr`` -> ``optim.lr``, ``critic.lr``), then
    keys whose last part is spelt close to ``key``'s (``temprature`` ->
    ``rollout.temperature``), then keys spelt close to it in full (``optm.lr`` ->
    ``optim.lr``); each group in the order of ``known``."""
    known = list(known)
    leaf = key.rsplit(".", 1)[-1]
    by_leaf: dict[str, list[str]] = {}
    for path in known:
        by_leaf.setdefault(path.rsplit(".", 1)[-1], []).append(path)
    found = [
        *by_leaf.get(leaf, []),
        *(p for close in difflib.get_close_matches(leaf, by_leaf, n=n) for p in by_leaf[close]),
        *difflib.get_close_matches(key, known, n=n),
    ]
    return list(dict.fromkeys(p for p in found if p != key))[:n]
