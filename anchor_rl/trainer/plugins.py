"""Plug-ins and the registries a config names: estimators, policy losses, engines, components.

A plug-in is a module or a Python file imported before the rest of a config is checked, so
that what it registers can be named there. The registries are imported when a name is
checked, so importing the config needs no torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from anchor_rl.errors import AnchorRLError


def engines() -> Any:
    """The engine registry with the built-in engines registered: ``hf``, ``http``
    (anchor_rl.rollout.http) and ``ray`` (anchor_rl.cluster, Ray imported only when used)."""
    import anchor_rl.cluster.engine  # noqa: F401  (registers "ray")
    import anchor_rl.rollout.http  # noqa: F401  (registers "http")
    from anchor_rl.rollout.engine import ENGINES

    return ENGINES


def check_registered(kind: str, name: str) -> str:
    """``name`` if it is a registered ``estimator``, ``policy loss``, ``engine`` or
    ``component``; the registries are imported here, at validation, so importing the config
    needs no torch."""
    if kind == "engine":
        registry = engines()
    elif kind == "component":
        from anchor_rl.trainer.registry import COMPONENTS as registry
    elif kind == "estimator":
        from anchor_rl.algos.registry import ESTIMATORS as registry
    else:
        from anchor_rl.algos.registry import POLICY_LOSSES as registry
    try:
        registry.lookup(name)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None
    return name


def load_plugin(name: str) -> None:
    """Import a plug-in: a module name (``my_pkg.estimators``) or a Python file
    (``path/to/file.py``), once. Its imports register estimators, policy losses, engines
    and components."""
    import hashlib
    import importlib
    import importlib.util
    import sys

    if name.endswith(".py"):
        path = Path(name).resolve()
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
        module_name = f"anchor_rl_plugin_{path.stem}_{digest}"
        if module_name in sys.modules:
            return
        if not path.is_file():
            raise ValueError(f"plugin file {name!r} does not exist")
        spec = importlib.util.spec_from_file_location(module_name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            del sys.modules[module_name]
            raise _plugin_failed(name, exc) from exc
        return
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise ValueError(
            f"plugin {name!r} cannot be imported ({exc}); name an importable module or a .py file"
        ) from None
    except Exception as exc:
        raise _plugin_failed(name, exc) from exc


def _plugin_failed(name: str, exc: Exception) -> AnchorRLError:
    """The error for a plugin whose own code raised on import: names the plugin, the line."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""
    return AnchorRLError(
        f"plugin {name!r} raised {type(exc).__name__}: {exc}{where} while importing "
        "(--debug shows the traceback)"
    )
