"""anchor-rl's methods as a verl plug-in: PVPO, V0.5 and VAPO in verl 0.9.1's v1 trainer.

verl 0.9.1 hands a registered advantage estimator the token rewards, the response mask, the
algorithm config, the per-step ``uid`` and ``reward_baselines``, and its v1 trainer passes
no dataset field and no critic value to it. PVPO's per-prompt anchor, V0.5's prior and
VAPO's values therefore come from a trainer of ours, registered with verl's
``register_trainer`` and picked with ``trainer.v1.trainer_mode=anchor_rl``; what verl's
signatures can carry is registered too (docs/integrations.md, section "verl"):

    trainer       ``anchor_rl``          :class:`~.trainer.AnchorRLTrainer` (method switch
                                         ``anchor_rl.method``: pvpo, v05, vapo)
    estimators    ``anchor_rl_pvpo``     ``r - reward_baselines`` (the prompt's static anchor)
                  ``anchor_rl_v05``      ``r - reward_baselines`` (the fused baseline)
    policy loss   ``anchor_rl_ppo``      anchor-rl's clipped surrogate (clip-higher, dual
                                         clip only when asked), on verl's loss normaliser
    agent loop    ``anchor_rl_teacher``  PVPO's teacher trajectory in place of the last
                                         rollout of a prompt the reference never solves

Modules: :mod:`.config` (the ``anchor_rl`` config node, no verl import),
:mod:`.method` (anchors, the V0.5 prior and the advantage step on a ``DataProto``),
:mod:`.estimators`, :mod:`.losses` (the VAPO actor loss with the positive-example NLL),
:mod:`.rollout` (presampling and V0.5 top-ups through verl's rollout, the teacher agent
loop), :mod:`.trainer`, :mod:`.registry` (the trainer's start-up check that verl's
registries hold these names), :mod:`.compat` (verl's model build beside trl 1.16),
:mod:`.cpu` (a ``cpu`` platform for verl, used with ``VERL_PLATFORM=cpu``),
:mod:`.backend` (the ``anchor_rl`` rollout backend: ``actor_rollout_ref.rollout.name``), and
:mod:`.plugin`, which the ``verl.plugins`` entry point loads (``import verl`` in any
process registers every name above).

Nothing here imports verl, so the names below are readable without it.
"""

from __future__ import annotations

TRAINER = "anchor_rl"
"""The registered trainer: ``trainer.v1.trainer_mode=anchor_rl``."""
ESTIMATORS = {"pvpo": "anchor_rl_pvpo", "v05": "anchor_rl_v05", "vapo": "gae"}
"""``algorithm.adv_estimator`` of each method (VAPO keeps verl's ``gae`` name: it switches
verl's critic on; the trainer computes the decoupled, length-adaptive GAE itself)."""
POLICY_LOSSES = ("anchor_rl_ppo",)
"""Registered policy losses (``actor_rollout_ref.actor.policy_loss.loss_mode``)."""
AGENT_LOOPS = ("anchor_rl_teacher",)
"""Registered agent loops (set per prompt by the trainer, never by hand)."""
VERL_VERSION = "0.9.1"
"""The verl release this plug-in is written and tested against."""

__all__ = ["AGENT_LOOPS", "ESTIMATORS", "POLICY_LOSSES", "TRAINER", "VERL_VERSION"]
