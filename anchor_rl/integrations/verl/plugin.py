"""The ``verl.plugins`` entry point: importing this module registers every name of the plug-in.

verl imports each ``verl.plugins`` entry point at the end of ``import verl`` (and swallows a
failure at DEBUG level, so tests check the registries in a fresh process). The imports below
only load modules, whose own decorators register the names; they read no attribute, so a
module that is still being imported (``import verl`` triggered from inside it) is fine.
"""

import anchor_rl.integrations.verl.estimators  # noqa: F401  anchor_rl_pvpo, anchor_rl_v05, anchor_rl_ppo
import anchor_rl.integrations.verl.rollout  # noqa: F401  the anchor_rl_teacher agent loop
import anchor_rl.integrations.verl.trainer  # noqa: F401  the anchor_rl trainer
