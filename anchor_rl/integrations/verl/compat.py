"""verl 0.9.1 beside trl 1.16: the model build no longer asks trl for a class it lacks.

verl's ``apply_monkey_patch`` (``verl/models/transformers/monkey_patch.py``), which every
FSDP model build calls, patches ``AutoModelForCausalLMWithValueHead.state_dict`` whenever
``is_trl_available()`` says trl is importable, and imports that class from
``trl.experimental.ppo`` or else ``trl``. trl 1.16 (anchor-rl's ``trl`` and ``dev`` extras)
has it in neither place, so with both libraries installed every verl actor, reference or
critic build raised ``ImportError``.

:func:`patch` replaces the ``is_trl_available`` name in that one module with
:func:`value_head_available`: true only when the class can be imported from where verl
imports it. The patch verl makes is to that class alone, so skipping it when the class is
absent changes nothing else; with a trl that has the class, verl patches it as before.
Nothing else in verl is touched (``verl.utils.model.load_valuehead_model``, the one other
reader, keeps its own check). The plug-in applies it when it loads, i.e. in every process
that imports verl, unless ``VERL_USE_EXTERNAL_PLUGINS`` turns the plug-ins off.
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import cache

__all__ = ["patch", "value_head_available"]


@cache
def value_head_available() -> bool:
    """Whether ``AutoModelForCausalLMWithValueHead`` imports from ``trl.experimental.ppo`` or
    ``trl`` (verl's two places for it); False without trl."""
    if importlib.util.find_spec("trl") is None:
        return False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trl warns on any import from trl.experimental
        for module in ("trl.experimental.ppo", "trl"):
            try:
                if hasattr(importlib.import_module(module), "AutoModelForCausalLMWithValueHead"):
                    return True
            except ImportError:
                continue
    return False


def patch() -> None:
    """Point verl's model-build patching at :func:`value_head_available` (module docstring)."""
    import verl.models.transformers.monkey_patch as monkey_patch

    monkey_patch.is_trl_available = value_head_available
