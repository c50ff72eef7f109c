"""anchor-rl's methods as TRL ``GRPOTrainer`` plug-ins (docs/integrations.md).

- :class:`PVPOGRPOTrainer`: advantages ``r - V_sta(prompt)`` from the anchor store
  (presampled with ``anchor-rl presample`` or by the trainer on a prompt's first use),
  PVPO's group sampling applied to the dataset before training, and a teacher trajectory
  injected for the prompts the reference never solves, its behaviour log-probs ``log
  pi_gt`` in the importance ratio.
- :class:`V05GRPOTrainer`: V0.5's prior fused with each group's rewards (the real-time
  test of the prior), advantages ``r - b(prompt)``. The adaptive budget is not offered:
  TRL's generation API samples the same number of completions for every prompt.

Both train on an anchor-rl task (:func:`task_dataset` builds its dataset,
:func:`task_reward_function` its reward) and hold the method's pieces from
``anchor_rl.methods.pvpo`` / ``anchor_rl.methods.v05`` without an anchor-rl run. Modules:
``base`` (:class:`AnchoredGRPOTrainer`, the TRL hooks both override), ``pvpo``, ``v05``,
``checks`` (set-up checks), ``data`` (dataset and reward) and ``version`` (the TRL pin).

Importing this module checks that the installed TRL lies in :data:`SUPPORTED_TRL`.
"""

from __future__ import annotations

from anchor_rl.integrations.trl.version import (
    INSTALL_HINT,
    SUPPORTED_TRL,
    UnsupportedTRLError,
    check_trl_version,
)

try:
    import trl as _trl
except ImportError as _exc:  # pragma: no cover - trl is in the dev extra
    raise UnsupportedTRLError(
        f"anchor_rl.integrations.trl needs TRL {SUPPORTED_TRL} ({_exc}): {INSTALL_HINT}"
    ) from _exc

check_trl_version(_trl.__version__)

from anchor_rl.integrations.trl.base import AnchoredGRPOTrainer  # noqa: E402
from anchor_rl.integrations.trl.checks import UnsupportedFeatureError  # noqa: E402
from anchor_rl.integrations.trl.data import task_dataset, task_reward_function  # noqa: E402
from anchor_rl.integrations.trl.pvpo import PVPOGRPOTrainer  # noqa: E402
from anchor_rl.integrations.trl.v05 import V05GRPOTrainer  # noqa: E402

__all__ = [
    "SUPPORTED_TRL",
    "AnchoredGRPOTrainer",
    "PVPOGRPOTrainer",
    "UnsupportedFeatureError",
    "UnsupportedTRLError",
    "V05GRPOTrainer",
    "check_trl_version",
    "task_dataset",
    "task_reward_function",
]
