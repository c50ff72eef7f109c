"""The ``verl.plugins`` entry point: importing this module registers every name of the plug-in.

verl imports each ``verl.plugins`` entry point at the end of ``import verl`` (and swallows a
failure at DEBUG level, so tests check the registries in a fresh process). The imports below
only load modules, whose own decorators register the names; they read no attribute, so a
module that is still being imported (``import verl`` triggered from inside it) is fine.

Before them, in this order: the ``cpu`` platform is registered (and, with
``VERL_PLATFORM=cpu``, the CPU mode switched on: :mod:`.cpu`), because verl resolves its
platform the first time one of its worker modules is imported, which the imports below do;
then verl's model build is fixed for trl 1.16 (:mod:`.compat`). After them, the ``anchor_rl``
rollout backend is registered (:mod:`.backend`).
"""

from anchor_rl.integrations.verl import compat, cpu

cpu.register()
cpu.activate()
compat.patch()

import anchor_rl.integrations.verl.estimators  # noqa: E402, F401  anchor_rl_pvpo, anchor_rl_v05, anchor_rl_ppo
import anchor_rl.integrations.verl.rollout  # noqa: E402, F401  the anchor_rl_teacher agent loop
import anchor_rl.integrations.verl.trainer  # noqa: E402, F401  the anchor_rl trainer
from anchor_rl.integrations.verl import backend  # noqa: E402

backend.register()  # actor_rollout_ref.rollout.name=anchor_rl
