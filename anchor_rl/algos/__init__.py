"""Pure tensor math for RLVR (torch only).

Modules: :mod:`~anchor_rl.algos.advantages` (GRPO, Dr. GRPO, RLOO, PVPO, REINFORCE++),
:mod:`~anchor_rl.algos.gae` (GAE over policy tokens, length-adaptive lambda),
:mod:`~anchor_rl.algos.v05` (prior fusion and adaptive rollout budget),
:mod:`~anchor_rl.algos.losses` (policy/value/NLL losses, KL estimators, aggregation) and
:mod:`~anchor_rl.algos.registry` (the names presets use). See docs/algorithms.md.

Nothing is imported here, so the command line (:mod:`anchor_rl.cli`) loads without torch.
"""
