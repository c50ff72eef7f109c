"""The plug-in's start-up check: verl's registries hold the plug-in's own objects.

verl imports a ``verl.plugins`` entry point inside a ``try`` and logs a failure at DEBUG
level only, and its registries are plain dictionaries any plug-in can fill. A broken or
shadowed install would therefore run without an error and with another estimator, loss or
agent loop than anchor-rl's. :func:`check_registered`, called when the ``anchor_rl``
trainer starts, looks each name up in verl's registry in this process and requires the
plug-in's object there (not merely the name), and the trl fix of :mod:`.compat` in place.
"""

from __future__ import annotations

from typing import Any

from anchor_rl.errors import AnchorRLError
from anchor_rl.integrations.verl import AGENT_LOOPS, ESTIMATORS, POLICY_LOSSES, TRAINER

__all__ = ["PluginNotRegisteredError", "check_registered", "problems"]


class PluginNotRegisteredError(AnchorRLError, RuntimeError):
    """A name of the plug-in is missing from verl's registries, or holds another object."""


def _expected() -> list[tuple[str, str, dict[str, Any], Any]]:
    """``(registry, name, verl's registry, the plug-in's object)`` for every registered name."""
    from verl.experimental.agent_loop.agent_loop import _agent_loop_registry
    from verl.trainer.ppo.core_algos import ADV_ESTIMATOR_REGISTRY, POLICY_LOSS_REGISTRY
    from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY

    from anchor_rl.integrations.verl import estimators, rollout

    loop = rollout.TeacherAgentLoop
    return [
        ("trainer", TRAINER, TRAINER_REGISTRY, TRAINER_CLASS),
        ("advantage estimator", ESTIMATORS["pvpo"], ADV_ESTIMATOR_REGISTRY,
         estimators.pvpo_advantage),
        ("advantage estimator", ESTIMATORS["v05"], ADV_ESTIMATOR_REGISTRY,
         estimators.v05_advantage),
        ("policy loss", POLICY_LOSSES[0], POLICY_LOSS_REGISTRY, estimators.ppo_policy_loss),
        ("agent loop", AGENT_LOOPS[0], _agent_loop_registry,
         {"_target_": f"{loop.__module__}.{loop.__qualname__}"}),
    ]  # fmt: skip


TRAINER_CLASS = "anchor_rl.integrations.verl.trainer.AnchorRLTrainer"
"""The registered trainer, by name (the trainer module imports this one)."""


def _describe(value: Any) -> str:
    if isinstance(value, str):
        return value
    name = getattr(value, "__qualname__", None)
    return f"{getattr(value, '__module__', '?')}.{name}" if name else repr(value)


def problems() -> list[str]:
    """What is wrong with the plug-in's registrations in this process (empty: nothing)."""
    out = []
    for kind, name, registry, ours in _expected():
        if name not in registry:
            out.append(f"{kind} {name!r} is not registered")
        elif (
            registry[name] is not ours
            and registry[name] != ours
            and _describe(registry[name]) != ours
        ):
            out.append(
                f"{kind} {name!r} is registered to {_describe(registry[name])}, "
                f"not the plug-in's {_describe(ours)}"
            )
    import verl.models.transformers.monkey_patch as monkey_patch

    from anchor_rl.integrations.verl.compat import value_head_available

    if monkey_patch.is_trl_available is not value_head_available:
        out.append(
            "the trl fix of verl's model build is not applied (anchor_rl.integrations.verl.compat)"
        )
    return out


def check_registered() -> None:
    """Raise :class:`PluginNotRegisteredError` naming every problem :func:`problems` finds."""
    found = problems()
    if found:
        raise PluginNotRegisteredError(
            "anchor-rl's verl plug-in is not (fully) loaded in this process: "
            + "; ".join(found)
            + ". verl loads it through the 'verl.plugins' entry point at `import verl` and logs "
            'a failed import at DEBUG level only: run `python -c "import '
            'anchor_rl.integrations.verl.plugin"` to see the error, and check that '
            "VERL_USE_EXTERNAL_PLUGINS is unset (or names anchor_rl) and that no other "
            "plug-in registers these names"
        )
