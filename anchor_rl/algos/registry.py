"""Names the trainer and presets use to pick estimators, aggregation modes and KL kinds.

``ADVANTAGES`` maps a name to its estimator; ``ADVANTAGE_INPUTS`` lists, per name, the
keyword inputs it reads (required ones first), so a caller holding a superset of inputs
can call any estimator the same way through :func:`compute_advantage`.

Inputs by name: ``rewards[B]`` outcome rewards, ``index[B]`` group ids, ``anchor[B]`` the
prompt's baseline value (PVPO's static anchor, V0.5's fused baseline), ``token_rewards[B, T]``
per-token rewards with the outcome on the last policy token, ``dense_rewards[B, T]``
per-token rewards besides the outcome (e.g. ``-beta * kl``), ``mask[B, T]``, ``gamma`` the
discount.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from torch import Tensor

from anchor_rl.algos import advantages
from anchor_rl.algos.losses import AGG_MODES, KL_KINDS

__all__ = [
    "ADVANTAGES",
    "ADVANTAGE_INPUTS",
    "AGG_MODES",
    "KL_KINDS",
    "TOKEN_LEVEL",
    "compute_advantage",
    "get_advantage",
]

ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": advantages.grpo,
    "drgrpo": partial(advantages.grpo, scale_by_std=False),
    "rloo": advantages.rloo,
    "pvpo": advantages.pvpo,
    "v05": advantages.pvpo,  # r - b with b the V0.5 fused baseline, passed as ``anchor``
    "reinforce_pp": advantages.reinforce_pp,
    "reinforce_pp_baseline": advantages.reinforce_pp_baseline,
}

ADVANTAGE_INPUTS: dict[str, tuple[str, ...]] = {
    "grpo": ("rewards", "index"),
    "drgrpo": ("rewards", "index"),
    "rloo": ("rewards", "index"),
    "pvpo": ("rewards", "anchor"),
    "v05": ("rewards", "anchor"),
    "reinforce_pp": ("token_rewards", "mask", "gamma"),
    "reinforce_pp_baseline": ("rewards", "index", "mask", "dense_rewards", "gamma"),
}

TOKEN_LEVEL: frozenset[str] = frozenset({"reinforce_pp", "reinforce_pp_baseline"})
"""Estimators that return ``[B, T]``; the others return ``[B]``."""


def get_advantage(name: str) -> Callable[..., Tensor]:
    """The estimator registered as ``name``; KeyError listing the valid names otherwise."""
    try:
        return ADVANTAGES[name]
    except KeyError:
        raise KeyError(
            f"unknown advantage estimator {name!r}; valid names: {', '.join(ADVANTAGES)}"
        ) from None


def compute_advantage(name: str, **inputs: Any) -> Tensor:
    """Call estimator ``name`` with the entries of ``inputs`` it reads (``ADVANTAGE_INPUTS``).

    Inputs it does not read are ignored; a missing optional one takes the estimator's
    default (``gamma = 1``, no ``dense_rewards``); a missing required one raises TypeError
    naming it.
    """
    fn = get_advantage(name)
    return fn(**{key: inputs[key] for key in ADVANTAGE_INPUTS[name] if key in inputs})
