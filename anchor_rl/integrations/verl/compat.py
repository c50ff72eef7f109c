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
``verl.utils.model.load_valuehead_model``, the one other reader, keeps its own check, but it
loads a critic as ``AutoModelForTokenClassification`` with ``attn_implementation`` hard-coded
to ``flash_attention_2`` and falls back to that same trl class: without the flash-attn
package (a CPU, or a GPU machine without it) no critic loads. Where flash-attn is not
importable :func:`patch` also replaces that loader with :func:`value_model_loader`'s, which
loads the same class with ``sdpa`` (``eager`` when the model's config asks for it); with
flash-attn installed verl's loader is kept. The plug-in applies both when it loads, i.e. in
every process that imports verl, unless ``VERL_USE_EXTERNAL_PLUGINS`` turns the plug-ins off.
"""

from __future__ import annotations

import importlib.util
import warnings
from functools import cache
from typing import Any

__all__ = ["patch", "value_head_available", "value_model_loader"]


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


def value_model_loader(load: Any) -> Any:
    """verl's ``load_valuehead_model`` (``load``) with ``sdpa`` attention instead of
    flash-attention 2 (``eager`` when the model's config asks for it); ``load`` is kept as
    ``__wrapped__``."""

    def load_valuehead_model(local_path: str, torch_dtype: Any, model_config: Any,
                             trust_remote_code: bool) -> Any:  # fmt: skip
        from transformers import AutoModelForTokenClassification

        asked = getattr(model_config, "_attn_implementation", None)
        return AutoModelForTokenClassification.from_pretrained(
            pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype,
            config=model_config, attn_implementation="eager" if asked == "eager" else "sdpa",
            trust_remote_code=trust_remote_code,
        )  # fmt: skip

    load_valuehead_model.__wrapped__ = load  # type: ignore[attr-defined]
    return load_valuehead_model


def patch() -> None:
    """Point verl's model-build patching at :func:`value_head_available`, and its critic
    loader at :func:`value_model_loader` where flash-attn is not importable (module
    docstring)."""
    import verl.models.transformers.monkey_patch as monkey_patch

    monkey_patch.is_trl_available = value_head_available
    if importlib.util.find_spec("flash_attn") is None:
        import verl.utils.model as model_utils

        if not hasattr(model_utils.load_valuehead_model, "__wrapped__"):
            model_utils.load_valuehead_model = value_model_loader(model_utils.load_valuehead_model)
