"""Everything the trainer and presets pick by name: estimators, policy losses, aggregation
modes and KL kinds.

Estimators register with :func:`register_advantage` (in :mod:`anchor_rl.algos.advantages`,
or any module of yours that is imported before the config is validated: the trainer's
``plugins`` setting imports it); each records the keyword inputs it reads
(:data:`~anchor_rl.algos.advantages.INPUTS`), so a caller holding a superset of inputs calls
any estimator the same way through :func:`compute_advantage`. Policy losses register with
:func:`register_policy_loss` (:mod:`anchor_rl.algos.losses`).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from anchor_rl.algos.advantages import ESTIMATORS, INPUTS, Estimator, register_advantage
from anchor_rl.algos.losses import (
    AGG_MODES,
    KL_KINDS,
    POLICY_LOSSES,
    PolicyLoss,
    register_policy_loss,
)

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "INPUTS",
    "KL_KINDS",
    "POLICY_LOSSES",
    "Estimator",
    "compute_advantage",
    "get_advantage",
    "get_estimator",
    "get_policy_loss",
    "register_advantage",
    "register_policy_loss",
]


def get_estimator(name: str) -> Estimator:
    """The estimator registered as ``name``; KeyError listing the registered names otherwise."""
    return ESTIMATORS.lookup(name)


def get_advantage(name: str) -> Any:
    """The function of estimator ``name`` (see :func:`get_estimator`)."""
    return get_estimator(name).fn


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``; KeyError listing the registered names otherwise."""
    return POLICY_LOSSES.lookup(name)


def compute_advantage(name: str, **inputs: Any) -> Tensor:
    """Call estimator ``name`` with the entries of ``inputs`` it reads.

    Inputs it does not read are ignored; a missing optional one takes the estimator's
    default (``gamma = 1``, no ``dense_rewards``); a missing required one raises TypeError
    naming it and the inputs supplied.
    """
    estimator = get_estimator(name)
    try:
        return estimator.fn(**{key: inputs[key] for key in estimator.inputs if key in inputs})
    except TypeError as exc:
        missing = [key for key in estimator.inputs if key not in inputs]
        if not missing:
            raise
        raise TypeError(
            f"estimator {name!r} needs {exc}; inputs supplied: {', '.join(sorted(inputs))} "
            "(a method component supplies the others: docs/training.md)"
        ) from None
